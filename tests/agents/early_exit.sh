#!/bin/sh
# A test agent that gives up before reading its row (a missing dependency, a bad flag): exit 7, a line on stderr.
echo "early_exit: cannot start (no such model)" >&2
exit 7
