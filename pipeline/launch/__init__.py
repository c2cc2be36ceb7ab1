"""What a job launches, as plain data (printed by --dry-run and launched as printed).  May import any subpackage.

    launch_plan.py  engine layouts, vLLM arguments, Ray actor options, Mooncake's protocol and package
    placement.py    node roles as Ray custom resources
    recipe.py       the recipe's wall-clock budget over its stages
"""
