#!/bin/sh
# trainmon Slurm Prolog (slurm.conf: Prolog=/etc/slurm/trainmon-prolog.sh, PrologFlags=Alloc).
# Runs as root on every node of a job when it starts there. It does three optional things:
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
# 3. The run's owner: a file slurm-<job id> in TRAINMON_OWNER_CLAIMS (a directory of root's,
#    mode 0755) holding the job's uid. The exporter reads it at each trainer's HELLO, so only
#    that uid may write to the run slurm-<job id>, even if another user's process connects
#    first. The epilog removes it.
#
# All are reconciled first: an epilog that never ran (slurmd killed, an epilog that timed
# out) would leave its job in the map, so that dcgm-exporter emits the GPU's series a second
# time under that job, its user's grant on the socket, and its owner claim, until reboot. From
# node-local state only, by default: Slurm gives a GPU (gres/gpu, SLURM_JOB_GPUS) to one job
# at a time and frees it only after that job's epilog, so a job that held a GPU this job now
# has has ended on this node; the prolog records which job holds each GPU
# (TRAINMON_SLURM_STATE/gpus) and drops every entry of a job it finds displaced, as its epilog
# would have. No prolog asks slurmctld anything: a 1,000-node job starts 1,000 prologs at once.
# Jobs without GPUs are reconciled only with TRAINMON_RUNNING_JOBS (below), which asks Slurm;
# when Slurm cannot tell, nothing is dropped. Grants and revocations of the prolog and the
# epilog take a node-wide lock (flock), so a user's new job never loses access to the epilog
# of that user's previous job ending at the same moment.
#
# Settings, from /etc/default/trainmon-slurm if it exists (or the file TRAINMON_SLURM_DEFAULTS
# names):
#   TRAINMON_SOCKET        the exporter's socket          (/run/trainmon/trainmon.sock)
#   TRAINMON_JOB_MAP_DIR   the job map directory; empty: no map          (/run/trainmon-jobs)
#   TRAINMON_SOCKET_ACL    1: grant the job's user access; 0: leave the socket alone    (1)
#   TRAINMON_SLURM_STATE   which jobs hold a grant, per user      (/run/trainmon-slurm)
#   TRAINMON_OWNER_CLAIMS  the owner claims (the exporter's owner_claims_dir); empty: none
#                          (/run/trainmon-owners)
#   TRAINMON_RUNNING_JOBS  a command printing the ids of the jobs on this node, one a line,
#                          to reconcile jobs without GPUs too; empty: GPUs only     (empty)
#       e.g. timeout 10 squeue --noheader --nodelist="$SLURMD_NODENAME" --states=CF,R,S,CG --format=%A
#       (one call to slurmctld per prolog, from every node of a job at once: size slurmctld
#       for it, or leave it empty)
#
# A prolog that fails drains the node, so this one never fails: problems are logged (syslog,
# tag trainmon-prolog) and it exits 0.

[ -r "${TRAINMON_SLURM_DEFAULTS:=/etc/default/trainmon-slurm}" ] && . "$TRAINMON_SLURM_DEFAULTS"
: "${TRAINMON_SOCKET:=/run/trainmon/trainmon.sock}"
: "${TRAINMON_JOB_MAP_DIR=/run/trainmon-jobs}"
: "${TRAINMON_SOCKET_ACL:=1}"
: "${TRAINMON_SLURM_STATE:=/run/trainmon-slurm}"
: "${TRAINMON_OWNER_CLAIMS=/run/trainmon-owners}"
: "${TRAINMON_RUNNING_JOBS=}"

say() { logger -t trainmon-prolog -- "job ${SLURM_JOB_ID:-?}: $*" 2>/dev/null || echo "trainmon-prolog: $*" >&2; }

job=${SLURM_JOB_ID:-}
[ -n "$job" ] || { say "no SLURM_JOB_ID, nothing to do"; exit 0; }

# The claims directory, root's and writable by root only (the exporter ignores it otherwise).
# A marker made before Slurm is asked which jobs run here: a claim not older than it (the
# prolog of a job Slurm had not listed yet) is never dropped as stale.
claims=$TRAINMON_OWNER_CLAIMS
if [ -n "$claims" ]; then
  if [ -L "$claims" ]; then
    say "$claims is a symbolic link: owner claims left out"
    claims=
  elif ! { mkdir -p "$claims" && chown 0:0 "$claims" && chmod 0755 "$claims"; }; then
    say "cannot make $claims: owner claims left out"
    claims=
  fi
fi
marker=
if [ -n "$claims" ]; then
  marker=$claims/#listed.$$
  : > "$marker" || marker=
fi

# The jobs Slurm runs on this node (this one included), one id a line; reconcile=0 when Slurm
# cannot tell (no command, no node name, the command failed): then nothing is dropped.
nl='
'
reconcile=0
live=$job
if [ -z "$TRAINMON_RUNNING_JOBS" ]; then
  :
elif [ -z "${SLURMD_NODENAME:-}" ] && case $TRAINMON_RUNNING_JOBS in *SLURMD_NODENAME*) true ;; *) false ;; esac; then
  say "no SLURMD_NODENAME: stale jobs not reconciled"
elif listed=$(eval "$TRAINMON_RUNNING_JOBS" 2>/dev/null); then
  reconcile=1
  for j in $listed; do
    case $j in
      '' | *[!0-9]*) say "'$j' from TRAINMON_RUNNING_JOBS is not a job id: stale jobs not reconciled"; reconcile=0; break ;;
    esac
    live="$live$nl$j"
  done
else
  say "cannot list this node's jobs ($TRAINMON_RUNNING_JOBS): stale jobs not reconciled"
fi
is_live() { case "$nl$live$nl" in *"$nl$1$nl"*) return 0 ;; esac; return 1; }

# 0. Node-local: the jobs this job displaces from its GPUs have ended here. SLURM_JOB_GPUS only
# (gres/gpu, never shared between jobs); CUDA_VISIBLE_DEVICES may name a shared GPU (shards,
# MPS), where two live jobs hold one GPU. Each GPU's holder is recorded under the node's lock;
# a requeued job's entries on GPUs it no longer holds are forgotten.
stale=
if [ -n "${SLURM_JOB_GPUS:-}" ] && mkdir -p "$TRAINMON_SLURM_STATE/gpus"; then
  stale=$(
    (
      flock -w 30 9 || { say "$TRAINMON_SLURM_STATE locked for 30 s: displaced jobs not reconciled"; exit 0; }
      mine=
      for gpu in $(echo "$SLURM_JOB_GPUS" | tr ',' ' '); do
        case $gpu in *[!0-9.]* | .* | *.) continue ;; esac
        mine="$mine$nl$gpu"
        f=$TRAINMON_SLURM_STATE/gpus/$gpu
        [ -f "$f" ] && while read -r j; do
          case $j in '' | "$job" | *[!0-9]*) ;; *) echo "$j" ;; esac
        done < "$f"
      done > "$TRAINMON_SLURM_STATE/gpus/.displaced.$$"
      for f in "$TRAINMON_SLURM_STATE"/gpus/*; do
        [ -f "$f" ] || continue
        read -r j < "$f" || j=
        gpu=${f##*/}
        if grep -qx "$j" "$TRAINMON_SLURM_STATE/gpus/.displaced.$$" 2>/dev/null; then
          rm -f "$f"
        elif [ "$j" = "$job" ]; then
          case "$mine$nl" in *"$nl$gpu$nl"*) ;; *) rm -f "$f" ;; esac
        fi
      done
      for gpu in $(echo "$mine"); do
        echo "$job" > "$TRAINMON_SLURM_STATE/gpus/$gpu.tmp.$$" \
          && mv -f "$TRAINMON_SLURM_STATE/gpus/$gpu.tmp.$$" "$TRAINMON_SLURM_STATE/gpus/$gpu"
      done
      sort -u "$TRAINMON_SLURM_STATE/gpus/.displaced.$$"
      rm -f "$TRAINMON_SLURM_STATE/gpus/.displaced.$$"
    ) 9>>"$TRAINMON_SLURM_STATE/.lock"
  )
fi
for j in $stale; do say "job $j was displaced from its GPUs: it no longer runs here"; done
is_stale() { case "$nl$stale$nl" in *"$nl$1$nl"*) return 0 ;; esac; return 1; }
# gone J: job J has ended on this node, by the node's own state or by Slurm's answer
gone() { is_stale "$1" || { [ "$reconcile" = 1 ] && ! is_live "$1"; }; }
drops=0
{ [ "$reconcile" = 1 ] || [ -n "$stale" ]; } && drops=1

# 1. The job map. SLURM_JOB_GPUS holds the node's GPU indices allocated to the job;
# CUDA_VISIBLE_DEVICES holds the same in prolog and epilog on Slurm releases without it.
if [ -n "$TRAINMON_JOB_MAP_DIR" ]; then
  gpus=${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-}}
  if { [ -n "$gpus" ] || [ -d "$TRAINMON_JOB_MAP_DIR" ]; } \
    && mkdir -p "$TRAINMON_JOB_MAP_DIR" && chmod 0755 "$TRAINMON_JOB_MAP_DIR"; then
    (
      flock -w 10 9 || { say "job map locked for 10 s, skipped"; exit 0; }
      if [ "$drops" = 1 ] || [ -n "${SLURM_JOB_GPUS:-}" ]; then
        # off J FILE: job J is no longer on FILE's GPU (ended here, or this job requeued
        # onto other GPUs of this node)
        off() {
          gone "$1" && return 0
          [ "$1" = "$job" ] && [ -n "${SLURM_JOB_GPUS:-}" ] || return 1
          case ",$SLURM_JOB_GPUS," in *",${2##*/},"*) return 1 ;; esac
        }
        for f in "$TRAINMON_JOB_MAP_DIR"/*; do
          [ -f "$f" ] || continue
          old=0
          while read -r j; do off "$j" "$f" && { old=1; say "job $j is no longer on GPU ${f##*/}: dropped from $f"; }; done < "$f"
          [ "$old" = 1 ] || continue
          while read -r j; do off "$j" "$f" || echo "$j"; done < "$f" > "$f.tmp.$$"
          if [ -s "$f.tmp.$$" ]; then
            chmod 0644 "$f.tmp.$$" && mv -f "$f.tmp.$$" "$f" || say "cannot write $f"
          else
            rm -f "$f.tmp.$$" "$f"
          fi
        done
      fi
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
# it from another job of the same user on this node; under the node's lock, which the epilog
# takes too.
uid=${SLURM_JOB_UID:-}
dir=$(dirname "$TRAINMON_SOCKET")
revoke() {
  [ -d "$dir" ] && { setfacl -d -x "u:$1" "$dir" || say "setfacl on $dir failed"; }
  [ -S "$TRAINMON_SOCKET" ] && { setfacl -x "u:$1" "$TRAINMON_SOCKET" || say "setfacl on $TRAINMON_SOCKET failed"; }
}
if [ "$TRAINMON_SOCKET_ACL" = 1 ] && mkdir -p "$TRAINMON_SLURM_STATE/users"; then
  (
    flock -w 30 9 || { say "$TRAINMON_SLURM_STATE locked for 30 s: socket access not changed"; exit 0; }
    have_setfacl=0
    command -v setfacl >/dev/null 2>&1 && have_setfacl=1
    if [ "$drops" = 1 ]; then
      for held in "$TRAINMON_SLURM_STATE"/users/*/*; do
        [ -f "$held" ] || continue
        j=${held##*/}
        gone "$j" || continue
        rm -f "$held"
        u=${held%/*}
        u=${u##*/}
        say "job $j of uid $u no longer runs here: its grant dropped"
        if rmdir "$TRAINMON_SLURM_STATE/users/$u" 2>/dev/null && [ "$have_setfacl" = 1 ]; then
          revoke "$u"
        fi
      done
    fi
    if [ -z "$uid" ] || [ "$uid" = 0 ]; then
      exit 0
    elif [ "$have_setfacl" = 0 ]; then
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
  ) 9>>"$TRAINMON_SLURM_STATE/.lock"
fi

# 3. The owner claim of the run slurm-<job id>: written to a temporary name, then renamed, so
# the exporter reads a whole claim or none.
if [ -n "$claims" ]; then
  if [ "$drops" = 1 ] && [ -n "$marker" ]; then
    for f in "$claims"/slurm-*; do
      [ -f "$f" ] || continue
      j=${f##*/slurm-}
      case $j in '' | *[!0-9]*) continue ;; esac
      gone "$j" || continue
      [ "$marker" -nt "$f" ] || continue  # not older than the listing (same clock tick too)
      rm -f "$f" && say "job $j no longer runs here: its owner claim dropped"
    done
  fi
  numbers=1
  case $job in '' | *[!0-9]*) numbers=0 ;; esac
  case $uid in '' | *[!0-9]*) numbers=0 ;; esac
  if [ "$numbers" = 0 ]; then
    say "job '$job' or uid '$uid' is not a number: no owner claim"
  else
    tmp=$claims/#claim.$$
    { echo "$uid" > "$tmp" && chmod 0644 "$tmp" && mv -f "$tmp" "$claims/slurm-$job"; } \
      || { rm -f "$tmp"; say "cannot write $claims/slurm-$job"; }
  fi
fi
[ -z "$marker" ] || rm -f "$marker"
exit 0
