#!/bin/bash
# Submit the whole chain: stk-scan -> stk-cache -> stk-train, each job starting only when the one
# before it succeeded (--dependency=afterok). Prints "STAGE JOBID" per submitted job.
#
#   DATA=/data/images MODEL=/models/sdxl-base RUN=/shared/run1 STK_CONFIG=etc/stk.toml sbatch/pipeline.sh
#   RUN=/shared/run1 MODEL=/models/sdxl-base sbatch/pipeline.sh --from train      # scan and cache exist
#   DATA=... MODEL=... RUN=... sbatch/pipeline.sh -- --nodes=2 --partition=h100    # sbatch options for all
#
# RUN (shared storage) holds scan/, cache/ and train/ unless SCAN, CACHE or OUT say otherwise
# (CACHE may be s3://...). Cluster size and the rest are ordinary sbatch options after "--",
# applied to every job; options for one command come from STK_CONFIG or STK_<COMMAND>_<OPTION>.
set -euo pipefail
usage() { sed -n '2,13s/^# \{0,1\}//p' "$0"; exit "${1:-0}"; }

from=scan
while [ $# -gt 0 ]; do
    case "$1" in
        --from) from="${2:?--from needs scan, cache or train}"; shift 2 ;;
        --from=*) from="${1#--from=}"; shift ;;
        -h|--help) usage 0 ;;
        --) shift; break ;;
        *) echo "pipeline.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$from" in scan|cache|train) ;; *) echo "pipeline.sh: --from $from: choose scan, cache or train" >&2; exit 2 ;; esac

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export STK_HOME="${STK_HOME:-$(dirname "$here")}"
: "${RUN:?set RUN to a run directory on shared storage}"
: "${MODEL:?set MODEL to a diffusers directory or hub id}"
export MODEL SCAN="${SCAN:-$RUN/scan}" CACHE="${CACHE:-$RUN/cache}" OUT="${OUT:-$RUN/train}"
[ "$from" = scan ] && : "${DATA:?set DATA to the image directory or s3:// prefix}"
mkdir -p logs   # the templates write logs/%x-%j.out relative to where they are submitted

previous=""
submit() {  # submit STAGE TEMPLATE [VAR=VALUE...]: exported variables reach the job
    local stage="$1" template="$2"
    shift 2
    local dependency=()
    [ -n "$previous" ] && dependency=(--dependency="afterok:$previous" --kill-on-invalid-dep=yes)
    previous="$(env "$@" sbatch --parsable "${dependency[@]}" "${sbatch_options[@]}" "$here/$template")"
    previous="${previous%%;*}"
    echo "$stage $previous"
}

sbatch_options=("$@")
started=""
for stage in scan cache train; do
    [ "$stage" = "$from" ] && started=1
    [ -z "$started" ] && continue
    case "$stage" in
        scan) submit scan scan.sbatch OUT="$SCAN" ;;
        cache) submit cache cache.sbatch ;;
        train) submit train train.sbatch ;;
    esac
done
