# Shared by the stk sbatch templates: where stk is, the config file, the health gate, and the
# requeue that follows a checkpoint. Sourced, not run.
#
# STK_HOME    the stk checkout (default: the directory sbatch was called from); its bin/ goes on PATH
# STK_CONFIG  a TOML file with [scan], [cache], [train], [launch] tables (passed as --config)
# STK_MPI     how stk-scan and stk-cache start their ranks: hydra (the default) is the mpiexec of
#             MPICH (the default install), which starts its proxies with srun and serves the ranks'
#             PMI itself; pmi2 (MPICH) or pmix (OpenMPI) start them with `srun --mpi=STK_MPI`. Slurm
#             22.05's pmi2 plugin hangs on MPICH's longer PMI requests across nodes: keep hydra there.
# STK_HEALTH_GATE=0 skips the health gate; STK_HEALTH_ARGS adds options to its stk-health check

STK_HOME="${STK_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}"
export PATH="$STK_HOME/bin:$PATH"
export HDF5_USE_FILE_LOCKING=FALSE   # fcntl locks fail or hang on NFS and Lustre
STK_MPI="${STK_MPI:-hydra}"
stk_config=()
[ -n "${STK_CONFIG:-}" ] && stk_config=(--config "$STK_CONFIG")

# One `stk-health check --drain` per node, in parallel. A node with a CRITICAL finding drains
# itself (Reason="stk-health: ..."); the job then requeues itself, so it starts again on healthy
# nodes instead of burning the others' GPUs on a run that will die. UNKNOWN (no driver, NVML not
# answering) is logged and let through: stk-health cannot tell.
stk_health_gate() {
    [ "${STK_HEALTH_GATE:-1}" = 0 ] && return 0
    local gpus="${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE##*:}}"
    local nodes="${SLURM_JOB_NUM_NODES:-1}"
    local step=(--nodes="$nodes" --ntasks="$nodes" --ntasks-per-node=1 --kill-on-bad-exit=0)
    [ -n "$gpus" ] && step+=(--gpus-per-node="$gpus")
    local report
    # --label: each line starts with the task (= node) number; stk-health prints one line per node
    report="$(srun "${step[@]}" --label stk-health check --drain --format text ${STK_HEALTH_ARGS:-} 2>&1)" || true
    echo "$report" | sed 's/^/stk health gate: /' >&2
    if echo "$report" | grep -q "^ *[0-9]*: CRITICAL"; then
        echo "stk health gate: a node failed its GPU check and was drained; requeueing job $SLURM_JOB_ID" >&2
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    return 0
}

# stk_ranks: the command that starts a program once per task of the allocation, as one MPI world
# (see STK_MPI): "${stk_ranks[@]}" stk-cache ...
stk_ranks=(srun --mpi="$STK_MPI")
if [ "$STK_MPI" = hydra ]; then
    stk_mpiexec="$STK_HOME/.venv/bin/mpiexec"   # beside the python mpi4py runs in, as stk-launch picks
    [ -x "$stk_mpiexec" ] || stk_mpiexec="$(command -v mpiexec || echo mpiexec)"
    # hydra reads the hosts and tasks per node from Slurm; the variable only makes its srun warn
    stk_ranks=(env -u SLURM_NTASKS_PER_NODE "$stk_mpiexec" -n "${SLURM_NTASKS:-1}")
fi

# Run a command (srun, stk-launch) in the background so the batch shell can take Slurm's
# --signal=B:USR2 (time limit, preemption) and pass it on; when the command exits 75
# (checkpointed, requeue me) or 69 (storage, network or a peer rank failed: a rerun, maybe on
# other nodes, resumes), requeue. On 76 (a GPU failed in training) the health gate runs again: the
# node it finds sick drains itself and the job requeues onto others; if it finds none, the job
# ends with 76. Every template runs its command through it.
stk_run_requeueable() {
    "$@" &
    local child=$!
    trap 'echo "stk: $(date +%T) signal received, asking the run to checkpoint" >&2; kill -USR2 '"$child"' 2>/dev/null' USR2 TERM
    local code=0
    wait "$child" || code=$?
    while kill -0 "$child" 2>/dev/null; do   # wait was cut short by the trapped signal
        code=0
        wait "$child" || code=$?
    done
    trap - USR2 TERM
    local why=""
    case "$code" in
        75) why="checkpointed" ;;
        69) why="storage, the network or a peer rank failed (exit 69; its reason is logged above)" ;;
        76) echo "stk: $(date +%T) a GPU failed during the run (exit 76); checking every node" >&2
            stk_health_gate ;;   # the sick node drains itself and the job requeues, to resume elsewhere
    esac
    if [ -n "$why" ]; then
        echo "stk: $(date +%T) $why; requeueing job $SLURM_JOB_ID to continue" >&2
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    return "$code"
}
