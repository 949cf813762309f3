"""``python cli.py ...`` from a checkout: the same as the installed ``lit3d`` command (`lit3d.cli`)."""

from lit3d.cli import main

if __name__ == "__main__":
    main()
