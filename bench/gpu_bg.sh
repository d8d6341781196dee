#!/usr/bin/env bash
# Run bench/gpu_checks.sh stages in the background on a device machine, so that one lease can
# outlast the 10-minute limit of a single device call:
#   bench/gpu_bg.sh start SECONDS STAGE...   starts the stages detached, then collects
#   bench/gpu_bg.sh collect SECONDS          waits up to SECONDS for them, then packs what exists
# Each call packs everything written so far into $OUT/gpu_results.tgz, so a later call that never
# comes (the machine went back) loses only the stages still running.
set -u
RES=/tmp/gpu_results
[ $# -ge 2 ] || { echo "usage: bench/gpu_bg.sh start SECONDS STAGE... | collect SECONDS"; exit 2; }
mode=$1; wait_s=$2; shift 2
case $mode in start|collect) ;; *) echo "unknown mode $mode (start or collect)"; exit 2 ;; esac
case $wait_s in ''|*[!0-9]*) echo "SECONDS must be a whole number of seconds, not '$wait_s'"; exit 2 ;; esac
if [ "$mode" = start ]; then
  rm -rf "$RES" && mkdir -p "$RES"  # a second start on a warm machine must not see the last DONE
  setsid nohup bash -c "OUT=$RES bench/gpu_checks.sh $*; touch $RES/DONE" > "$RES/all.log" 2>&1 < /dev/null &
fi
end=$((SECONDS + wait_s))
while [ ! -e "$RES/DONE" ] && [ $SECONDS -lt $end ]; do sleep 5; done
[ -e "$RES/DONE" ] && echo "ALL STAGES DONE" || echo "still running"
tail -c 9000 "$RES/all.log"
tar czf "${OUT:-/tmp}/gpu_results.tgz" -C "$RES" .
