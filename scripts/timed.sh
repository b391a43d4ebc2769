#!/usr/bin/env bash
# timed.sh NAME COMMAND...: run one phase of `make test` and print its wall time, failed or not, so that a slow
# or failing step stands out in a CI log. The exit status is the command's.
name=$1
shift
start=$(date +%s)
echo "=== phase: $name"
status=0
"$@" || status=$?
echo "=== phase: $name took $(( $(date +%s) - start )) s (exit $status)"
exit $status
