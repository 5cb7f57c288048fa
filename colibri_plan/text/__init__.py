"""Text around the engine: a pack's tokenizer and chat template (``codec``, ``chat``), the streaming
detokenizer and stop strings (``stream``), and token sampling (``sampling``). The engine itself runs on
token ids; `run --prompt` and `serve` turn text into ids and back here."""
