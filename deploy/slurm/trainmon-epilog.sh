#!/bin/sh
# trainmon Slurm Epilog (slurm.conf: Epilog=/etc/slurm/trainmon-epilog.sh): undoes what
# trainmon-prolog.sh did when a job ends on a node. Removes the job's id from every file of the
# job map (and a file left empty), and takes the socket ACL entries of the job's user away once
# none of that user's jobs on this node holds them, under the lock the prolog takes, forgets the
# GPUs the job held, and removes the run's owner claim. Same settings as the prolog; never
# fails.

[ -r "${TRAINMON_SLURM_DEFAULTS:=/etc/default/trainmon-slurm}" ] && . "$TRAINMON_SLURM_DEFAULTS"
: "${TRAINMON_SOCKET:=/run/trainmon/trainmon.sock}"
: "${TRAINMON_JOB_MAP_DIR=/run/trainmon-jobs}"
: "${TRAINMON_SOCKET_ACL:=1}"
: "${TRAINMON_SLURM_STATE:=/run/trainmon-slurm}"
: "${TRAINMON_OWNER_CLAIMS=/run/trainmon-owners}"

say() { logger -t trainmon-epilog -- "job ${SLURM_JOB_ID:-?}: $*" 2>/dev/null || echo "trainmon-epilog: $*" >&2; }

job=${SLURM_JOB_ID:-}
[ -n "$job" ] || { say "no SLURM_JOB_ID, nothing to do"; exit 0; }

if [ -n "$TRAINMON_JOB_MAP_DIR" ] && [ -d "$TRAINMON_JOB_MAP_DIR" ]; then
  (
    flock -w 10 9 || { say "job map locked for 10 s, skipped"; exit 0; }
    for f in "$TRAINMON_JOB_MAP_DIR"/*; do
      [ -f "$f" ] || continue
      grep -qx "$job" "$f" || continue
      grep -vx "$job" "$f" > "$f.tmp.$$"
      if [ -s "$f.tmp.$$" ]; then
        chmod 0644 "$f.tmp.$$" && mv -f "$f.tmp.$$" "$f" || say "cannot write $f"
      else
        rm -f "$f.tmp.$$" "$f"
      fi
    done
  ) 9>>"$TRAINMON_JOB_MAP_DIR/.lock"
fi

# Under the node's lock, which the prolog takes too: a prolog granting the same user access for
# a new job waits, or is waited for, so the grant it makes is never revoked here.
uid=${SLURM_JOB_UID:-}
held=$TRAINMON_SLURM_STATE/users/$uid
if { [ "$TRAINMON_SOCKET_ACL" = 1 ] && [ -n "$uid" ] && [ -d "$TRAINMON_SLURM_STATE/users" ]; } \
  || [ -d "$TRAINMON_SLURM_STATE/gpus" ]; then
  (
    flock -w 30 9 || { say "$TRAINMON_SLURM_STATE locked for 30 s: socket access not changed"; exit 0; }
    for f in "$TRAINMON_SLURM_STATE"/gpus/*; do  # the GPUs this job held are free
      [ -f "$f" ] && read -r j < "$f" && [ "$j" = "$job" ] && rm -f "$f"
    done
    [ "$TRAINMON_SOCKET_ACL" = 1 ] && [ -n "$uid" ] && [ -d "$held" ] || exit 0
    rm -f "$held/$job"
    if rmdir "$held" 2>/dev/null && command -v setfacl >/dev/null 2>&1; then
      dir=$(dirname "$TRAINMON_SOCKET")
      [ -d "$dir" ] && { setfacl -d -x "u:$uid" "$dir" || say "setfacl on $dir failed"; }
      [ -S "$TRAINMON_SOCKET" ] && { setfacl -x "u:$uid" "$TRAINMON_SOCKET" || say "setfacl on $TRAINMON_SOCKET failed"; }
    fi
  ) 9>>"$TRAINMON_SLURM_STATE/.lock"
fi

# The run's owner claim: slurm-<job id> is free again.
case $job in
  *[!0-9]*) ;;
  *) [ -z "$TRAINMON_OWNER_CLAIMS" ] || [ -L "$TRAINMON_OWNER_CLAIMS" ] \
    || rm -f "$TRAINMON_OWNER_CLAIMS/slurm-$job" ;;
esac
exit 0
