#!/usr/bin/env bash
# A/B of the CPU decode kernel between two revisions of this repository, on this machine. Both builds of
# decode_attention.cpp run in turn, in the order A B, then B A (so that a drift of the machine falls on both
# equally), each run a fresh process with its own pool and read probe; each round gives the ratios B / A of
# ns per key from DRAM and from cache, and the end prints their medians. Why: on a shared host the machine's
# speed moves by tens of percent within minutes (read rate 9-25 GB/s in one session), so two tables taken
# apart cannot show a 5% change; runs seconds apart see nearly the same machine.
#
#   benchmarks/native/ab.sh A B [kind [rounds [batch context group head_dim threads]]]
#
# A, B: git revisions, or "." for the working tree. kind: bf16 (default), fp16, int8, fp8, int4, kivi4,
# kivi2; rounds: 4 by default (each round is two runs of ~10-30 s). The rest goes to decode_attention
# (default 8 x 32k tokens, GQA 4, head_dim 128, 2 threads). Example: benchmarks/native/ab.sh HEAD~1 . int4 6
set -euo pipefail
usage="usage: benchmarks/native/ab.sh A B [kind [rounds [batch context group head_dim threads]]]"
root=$(cd "$(dirname "$0")/../.." && pwd)
a=${1:?$usage}
b=${2:?$usage}
kind=${3:-bf16}
rounds=${4:-4}
shift $(($# < 4 ? $# : 4))
extra=("$@")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

build() { # build REV NAME: that revision's csrc and benchmarks, built into $work/build-NAME
  local src="$work/src-$2"
  mkdir -p "$src"
  if [ "$1" = "." ]; then
    cp -r "$root/csrc" "$root/benchmarks" "$src/"
  else
    git -C "$root" archive "$1" csrc benchmarks | tar -x -C "$src"
  fi
  cmake -S "$src/benchmarks/native" -B "$work/build-$2" -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
  cmake --build "$work/build-$2" --target decode_attention > /dev/null
}
echo "building A ($a) and B ($b) ..."
build "$a" a &
pa=$!
build "$b" b &
pb=$!
wait "$pa"
wait "$pb"

run() { # run NAME: "DRAM cache" ns per key per KV head per core (the run's whole output in $work/out-NAME)
  KVC_BENCH_NO_PHASES=1 "$work/build-$1/decode_attention" "$kind" "${extra[@]}" > "$work/out-$1"
  sed -nE 's/^step .*from DRAM ([0-9.]+), from cache ([0-9.]+).*/\1 \2/p' "$work/out-$1"
}
ratios=()
for ((i = 1; i <= rounds; i++)); do
  if ((i % 2)); then
    ra=$(run a)
    rb=$(run b)
  else
    rb=$(run b)
    ra=$(run a)
  fi
  if ((i == 1)); then
    head -1 "$work/out-a"
    echo "ns per key per KV head per core, from DRAM / from cache; ratios B / A"
  fi
  read -r da ca <<< "$ra"
  read -r db cb <<< "$rb"
  r=$(awk -v da="$da" -v ca="$ca" -v db="$db" -v cb="$cb" 'BEGIN { printf "%.3f %.3f", db / da, cb / ca }')
  ratios+=("$r")
  echo "round $i: A $da / $ca  B $db / $cb  B/A $r"
done
median() { sort -g | awk '{ x[NR] = $1 } END { print (NR % 2 ? x[(NR + 1) / 2] : (x[NR / 2] + x[NR / 2 + 1]) / 2) }'; }
dram=$(printf '%s\n' "${ratios[@]}" | cut -d' ' -f1 | median)
cache=$(printf '%s\n' "${ratios[@]}" | cut -d' ' -f2 | median)
echo "median B/A over $rounds rounds: from DRAM $dram, from cache $cache"
