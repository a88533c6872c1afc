"""Errors hpcrlhf raises on purpose.

Every failure caused by user input (a recipe, a `--set` value, a data row, a model folder, a
layout) is one of these, with a message that names the field, the value and the fix. Anything
else escaping to the user is a bug.
"""


class HpcrlhfError(Exception):
    """Base class: a problem the user can fix, explained in the message."""


class ConfigError(HpcrlhfError):
    """A recipe, a `--set` override or a config value is invalid."""


class DataError(HpcrlhfError):
    """A dataset, a data file or one of its rows is invalid (the message names file and line)."""


class ModelError(HpcrlhfError):
    """A model path, family or attention implementation cannot be used."""


class PlacementError(ConfigError):
    """A node map that cannot work on its allocation or for its config. The message lists every
    problem found, each with its reason and fix; `problems` holds them one by one."""

    def __init__(self, message: str, problems: tuple[str, ...] = ()):
        super().__init__(message)
        self.problems = problems


class RuleError(HpcrlhfError):
    """A user's reward rule or evaluation metric (`module:function`) raised an exception or returned no
    real number; the message names the rule, the config field, the prompt's row and the value."""


class AgentEnvError(HpcrlhfError):
    """A user's agent environment (`agent.environment`) raised, or broke its contract (what `reset` or
    `step` must return); the message names the class, the method, the row and the seed."""


class RewardServerError(HpcrlhfError):
    """A reward server (`reward.sources[i].url`) refused a request, or failed it on every try: the
    message names the URL and what came back (hpcrlhf.rewards.remote)."""


class TrainingError(HpcrlhfError):
    """Training cannot go on (e.g. NaN/Inf in the loss, rewards or gradients); the message names
    the step and the tensor, and says how to resume."""


class WorkerLost(TrainingError):
    """A worker process or a whole node died mid-run: nothing the user did, and nothing lost but the
    steps since the last checkpoint. The CLI exits `hpcrlhf.run.signals.EXIT_LOST` for it, on which
    hpcrlhf's Slurm jobs requeue themselves and resume (on healthy nodes: Slurm never starts a job on
    a node it has marked down)."""


class Hung(WorkerLost):
    """A wait passed its watchdog deadline (hpcrlhf.run.watchdog): the job ends as for a lost worker
    (exit 4, requeued), naming what hung and where its stacks are. `parties`: whom the wait was for."""

    def __init__(self, message: str, parties: tuple[str, ...] = ()):
        super().__init__(message)
        self.parties = parties


class UnsafeFileError(HpcrlhfError):
    """A path hpcrlhf is about to write is not what it writes there: a symbolic link (hpcrlhf never
    writes through one), a file with other hard links, a FIFO, a device or a folder in place of a file.
    The message names the path and what is there (hpcrlhf.run.files)."""
