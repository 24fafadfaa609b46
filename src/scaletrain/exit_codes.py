"""Exit codes the command, the ranks, the agent and the scheduler scripts agree on (imports nothing: any layer may
read them)."""

EXIT_FAILED = 1  # training failed; the message points at the failing rank's log
EXIT_BAD_INPUT = 2  # a user error, reported in one line before any work starts (click's own usage errors too)
EXIT_REQUEUE = 75  # EX_TEMPFAIL from sysexits.h: "try again later" -- a checkpoint was saved, requeue the job
EXIT_HANG = 124  # like timeout(1): the run stopped making progress
