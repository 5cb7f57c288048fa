from colibri_plan.cli import main

main()
