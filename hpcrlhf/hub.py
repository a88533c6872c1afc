"""Whether a name the user gave can come from the Hugging Face hub, answered at once.

A model or data path that is not on disk may be a hub name. Handed to transformers or datasets as
it is, such a name costs ~55 s (a model) or ~29 s (a dataset) of retries on a machine without hub
access before an OSError that no longer says it was also no local path (measured). So before any
loader sees a name that is not on disk, `hub_problem` says why the hub cannot provide it, or None:

- the name cannot be a hub id (`./x`, `/abs/path`, `a/b/c`, spaces...): it can only be a path;
- the hub is off for this process: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE; HF_DATASETS_OFFLINE
  for datasets) read as huggingface_hub and datasets read them -- unless the model is in the
  local hub cache, from which the loaders then read it;
- the hub does not answer within `PROBE_TIMEOUT_S` (one request to its API: no network, no DNS,
  a firewall) and the local hub cache lacks the model (with it, the loaders read the cache: a
  warning says so), or it answers that there is no such repository.

A gated repository counts as there (loading it then needs a token with access), and so does any
other answer of the hub (a server error is the loader's to report).
"""

from __future__ import annotations

import functools
import os
from typing import Literal

from hpcrlhf.logs import get_logger

RepoType = Literal["model", "dataset"]

PROBE_TIMEOUT_S = 5.0
"""The longest one question to the hub may take: a reachable hub answers in well under a second."""


def is_hub_id(name: str) -> bool:
    """Whether `name` could be a hub repository id (`name` or `org/name`)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def offline_setting(repo_type: RepoType = "model") -> str | None:
    """The environment variable that turns the hub off for this process (None: it is on). Read
    now, with huggingface_hub's rule (1/ON/YES/TRUE, any case); for datasets HF_DATASETS_OFFLINE,
    when set, decides, as in datasets."""
    from huggingface_hub.constants import ENV_VARS_TRUE_VALUES

    names = ("HF_DATASETS_OFFLINE",) if repo_type == "dataset" and "HF_DATASETS_OFFLINE" in os.environ else ()
    for name in names or ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = os.environ.get(name)
        if value is not None:
            return f"{name}={value}" if value.upper() in ENV_VARS_TRUE_VALUES else None
    return None


def model_in_hub_cache(name: str) -> bool:
    """Whether the local hub cache holds model `name` (its config.json: a cheap tell; datasets keep a
    cache of their own)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(name, "config.json"), str)


def hub_problem(name: str, repo_type: RepoType = "model") -> str | None:
    """Why the hub cannot provide `name` now, as a clause (`the hub is off (HF_HUB_OFFLINE=1)`),
    or None when it can (or the model is in the local hub cache and the hub is off)."""
    if not is_hub_id(name):
        return f"'{name}' cannot be a hub {repo_type} name (those are NAME or ORG/NAME)"
    off = offline_setting(repo_type)
    if off and repo_type == "model":
        return None if model_in_hub_cache(name) else f"the hub is off ({off}) and the local hub cache lacks it"
    return f"the hub is off ({off})" if off else _probe(name, repo_type)


@functools.cache
def _probe(name: str, repo_type: RepoType) -> str | None:
    from huggingface_hub import HfApi
    from huggingface_hub.constants import ENDPOINT
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        HfApi().repo_info(name, repo_type=repo_type, timeout=PROBE_TIMEOUT_S)
    except GatedRepoError:
        return None
    except RepositoryNotFoundError:
        return f"the hub ({ENDPOINT}) has no {repo_type} of that name that your token can see"
    except HfHubHTTPError:
        return None
    except Exception as e:  # no answer: connection refused, DNS, timeout (httpx's errors, not OSErrors)
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if repo_type == "model" and model_in_hub_cache(name):  # loads from the cache, after the loader's retries
            get_logger().warning(f"the hub ({ENDPOINT}) cannot be reached ({why}): loading '{name}' from the local hub "
                                 "cache; set HF_HUB_OFFLINE=1 to skip the loader's retries")
            return None
        return f"the hub ({ENDPOINT}) cannot be reached: {why}"
    return None
