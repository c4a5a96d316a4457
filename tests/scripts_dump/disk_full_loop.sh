#!/bin/bash
# Manual check (root, Linux): train on a fresh 1 MiB tmpfs N times and count crashes.
# usage: disk_full_loop.sh REPO_ROOT statistics|tensor N   (FILL_KB=990: pre-fill the tmpfs)
root=$1; task=$2; n=$3
mkdir -p /tmp/lm13; crashes=0; inside=0; clean=0
for i in $(seq 1 $n); do
  mountpoint -q /tmp/lm13 && umount /tmp/lm13
  mount -t tmpfs -o size=1m tmpfs /tmp/lm13
  [ "$task" = statistics ] && head -c $((${FILL_KB:-800}*1024)) /dev/zero > /tmp/lm13/filler
  echo "{\"task\":\"$task\",\"dump_path\":\"/tmp/lm13/d\",\"level\":\"mix\"}" > /tmp/lm13c.json
  out=$(PYTHONPATH=$root timeout 120 ${PYTHON:-python3} $root/tests/scripts_dump/disk_full_child.py /tmp/lm13c.json 8 2>/tmp/lm13err); rc=$?
  if [ $rc -ne 0 ]; then crashes=$((crashes+1)); echo "run $i rc=$rc $(tail -c 300 /tmp/lm13err | tr '\n' ' ')"; continue; fi
  if echo "$out" | grep -q '"where": "\(forward\|backward\|optimizer\|stop\|start\)"'; then inside=$((inside+1)); else clean=$((clean+1)); fi
done
umount /tmp/lm13
echo "$root $task runs=$n crashed=$crashes raised_inside_training=$inside clean=$clean"
