"""The headless command line's commands (launch.py parses the arguments and calls them): runs, the queue,
the tools around training, and what a run shows in the terminal."""
