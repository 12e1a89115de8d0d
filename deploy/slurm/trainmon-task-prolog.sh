#!/bin/sh
# trainmon Slurm TaskProlog (slurm.conf: TaskProlog=/etc/slurm/trainmon-task-prolog.sh). Runs as
# the job's user, with the task's environment, before each task; every "export NAME=value" line
# it prints is set in the task's environment. It points the trainmon client at the node
# exporter's socket (TRAINMON_SOCKET from /etc/default/trainmon-slurm, else
# /run/trainmon/trainmon.sock), whatever the client's built-in default is, unless the job set
# TRAINMON_SOCKET itself. The run id needs nothing here: the client names the run
# slurm-$SLURM_JOB_ID on every node of the job.
if [ -z "${TRAINMON_SOCKET:-}" ]; then
  [ -r "${TRAINMON_SLURM_DEFAULTS:=/etc/default/trainmon-slurm}" ] && . "$TRAINMON_SLURM_DEFAULTS"
  echo "export TRAINMON_SOCKET=${TRAINMON_SOCKET:-/run/trainmon/trainmon.sock}"
fi
