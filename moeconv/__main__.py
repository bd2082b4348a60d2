"""`python -m moeconv`: the same command line as the `moeconv` script."""

from moeconv.cli import main

if __name__ == "__main__":  # not when a spawned worker process imports this module
    main()
