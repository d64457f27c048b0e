"""stk-launch: start stk-train on every GPU of a Slurm allocation, from the batch script.

It reads the allocation (`allocation`: hosts, ranks per node), works out the launch (`plan`:
DeepSpeed's hostfile, the rendezvous on the first host with a port derived from the job id, the
variables a multi-node run needs, and DeepSpeed's MPI launcher `--launcher mpich|openmpi` or
`srun --mpi=...`), runs it as a child, forwards stop signals to the ranks and exits with the
ranks' code (`supervise`). Ranks report to it through a status directory (`status`).

What DeepSpeed 0.19.8 and MPICH 5 do, measured here, and what stk does about it:

- Exit codes. MPICH's `mpiexec` returns 75 when every rank exits 75, but ORs different codes
  (75 on one rank and 76 on another gives 79). DeepSpeed's `--launcher mpich` starts each rank
  through its `launcher_helper.py`, which waits for the rank and then exits 0 whatever the rank
  returned, so `deepspeed` exits 0 when all ranks exit 75 (requeue) or 3 (bad input). Its runner
  also exits 0 when mpirun dies of a signal. So each rank is started by the rank script the CLI
  names (`RankEntry.script`), which calls `status.run_rank`: it records the rank's exit code in a
  status directory on the launching node; stk-launch takes the job's code from the codes of the
  ranks on its node (stk-train's step agreement makes every rank end the same way) and uses the
  launcher's code only when no local rank left one. With `--launcher openmpi` (no helper) and
  srun (the highest task code) the codes come through anyway; the status files agree with them.
- `--module` is broken with `--launcher mpich` (the runner puts `-m` before the helper's path),
  which is the other reason ranks start as `python .../rank.py ARGS`: that path must be the same
  on every node (a shared checkout or identical installs), as PYTHONPATH already is.
- Environment. MPICH's mpirun passes its whole environment to every rank (`-genvall`, made
  explicit); OpenMPI's passes only what `-x NAME` names, so stk-launch names the variables stk
  needs (STK_*, NCCL_*, TORCH_*, HDF5_*, DS_*, OMP_*, HF_*, AWS_*): by name only, so values
  (credentials) never appear in argv, and without the quoting DeepSpeed adds to the exports it
  writes itself (`.deepspeed_env` still works as DeepSpeed documents it).
- Signals. SIGUSR2 kills DeepSpeed's runner and its launcher helper (neither handles it), so a
  stop request never goes to the launcher. Inside an allocation MPICH's mpirun starts its
  proxies, and so the ranks, through srun: they run under slurmstepd, not below stk-launch, even
  on the batch host, so the process tree does not find them. Each rank registers instead (its
  status file is named HOST-PID), and SIGUSR2 or SIGTERM to stk-launch becomes SIGUSR2 to the
  registered ranks of this node, held until one of them handles it (SigCgt in /proc: a rank still
  importing torch would die of it); stk-train's step agreement tells the ranks on other nodes.
  With srun it goes to srun, which passes it to every task; srun exits with the highest task code.
"""
