"""`python -m moeconv`: the same command line as the `moeconv` script."""

from moeconv.cli import main

main()
