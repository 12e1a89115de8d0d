#!/bin/sh
# trainmon Slurm Prolog (slurm.conf: Prolog=/etc/slurm/trainmon-prolog.sh, PrologFlags=Alloc).
# Runs as root on every node of a job when it starts there. It does two optional things:
#
# 1. Job <-> GPU map in dcgm-exporter's --hpc-job-mapping-dir format: one file per GPU index
#    (named after the index: 0, 1, ...; "3.1" for a MIG instance) holding the ids of the jobs
#    on that GPU, one per line. dcgm-exporter then copies that GPU's series with label
#    hpc_job="<job id>"; trainmon names the same job's run "slurm-<job id>".
# 2. Socket access for the job's user: a POSIX ACL entry (setfacl) on the exporter's socket,
#    and a default ACL entry on its directory so that a socket the exporter re-creates after
#    a restart carries it too. The epilog removes them when the user's last job on the node
#    ends. The socket's mode is unchanged (0660 by default): other local users still cannot
#    connect.
#
# Settings, from /etc/default/trainmon-slurm if it exists (or the file TRAINMON_SLURM_DEFAULTS
# names):
#   TRAINMON_SOCKET        the exporter's socket          (/run/trainmon/trainmon.sock)
#   TRAINMON_JOB_MAP_DIR   the job map directory; empty: no map          (/run/trainmon-jobs)
#   TRAINMON_SOCKET_ACL    1: grant the job's user access; 0: leave the socket alone    (1)
#   TRAINMON_SLURM_STATE   which jobs hold a grant, per user      (/run/trainmon-slurm)
#
# A prolog that fails drains the node, so this one never fails: problems are logged (syslog,
# tag trainmon-prolog) and it exits 0.

[ -r "${TRAINMON_SLURM_DEFAULTS:=/etc/default/trainmon-slurm}" ] && . "$TRAINMON_SLURM_DEFAULTS"
: "${TRAINMON_SOCKET:=/run/trainmon/trainmon.sock}"
: "${TRAINMON_JOB_MAP_DIR=/run/trainmon-jobs}"
: "${TRAINMON_SOCKET_ACL:=1}"
: "${TRAINMON_SLURM_STATE:=/run/trainmon-slurm}"

say() { logger -t trainmon-prolog -- "job ${SLURM_JOB_ID:-?}: $*" 2>/dev/null || echo "trainmon-prolog: $*" >&2; }

job=${SLURM_JOB_ID:-}
[ -n "$job" ] || { say "no SLURM_JOB_ID, nothing to do"; exit 0; }

# 1. The job map. SLURM_JOB_GPUS holds the node's GPU indices allocated to the job;
# CUDA_VISIBLE_DEVICES holds the same in prolog and epilog on Slurm releases without it.
if [ -n "$TRAINMON_JOB_MAP_DIR" ]; then
  gpus=${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-}}
  if [ -n "$gpus" ] && mkdir -p "$TRAINMON_JOB_MAP_DIR" && chmod 0755 "$TRAINMON_JOB_MAP_DIR"; then
    (
      flock -w 10 9 || { say "job map locked for 10 s, skipped"; exit 0; }
      for gpu in $(echo "$gpus" | tr ',' ' '); do
        case $gpu in
          *[!0-9.]* | .* | *. ) say "GPU '$gpu' is not an index, left out of the job map"; continue ;;
        esac
        f=$TRAINMON_JOB_MAP_DIR/$gpu
        grep -qx "$job" "$f" 2>/dev/null && continue
        { cat "$f" 2>/dev/null; echo "$job"; } > "$f.tmp.$$" && chmod 0644 "$f.tmp.$$" \
          && mv -f "$f.tmp.$$" "$f" || say "cannot write $f"
      done
    ) 9>>"$TRAINMON_JOB_MAP_DIR/.lock"
  fi
fi

# 2. Socket access for the job's user, counted per job so the epilog of one job does not take
# it from another job of the same user on this node.
uid=${SLURM_JOB_UID:-}
if [ "$TRAINMON_SOCKET_ACL" = 1 ] && [ -n "$uid" ] && [ "$uid" != 0 ]; then
  dir=$(dirname "$TRAINMON_SOCKET")
  if ! command -v setfacl >/dev/null 2>&1; then
    say "setfacl not found (Debian/Ubuntu/RHEL package acl): socket access not granted"
  elif [ ! -d "$dir" ]; then
    say "$dir does not exist (is the exporter running?): socket access not granted"
  else
    mkdir -p "$TRAINMON_SLURM_STATE/users/$uid" && : > "$TRAINMON_SLURM_STATE/users/$uid/$job"
    # The grant never widens the socket's mode: the ACL mask stays the socket's group bits
    # (setfacl -n; a new socket gets the exporter's --socket-mode group bits as its mask), so
    # with --socket-mode 0600 nobody else connects. g::rw keeps --socket-group working.
    setfacl -d -m "u:$uid:rw,g::rw" "$dir" || say "setfacl on $dir failed"
    if [ -S "$TRAINMON_SOCKET" ]; then
      setfacl -n -m "u:$uid:rw" "$TRAINMON_SOCKET" || say "setfacl on $TRAINMON_SOCKET failed"
    fi
  fi
fi
exit 0
