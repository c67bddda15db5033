"""A parameter server's table settings: what ``configure`` sets for every table (the
embedding optimizer, the initialization and weight bounds, the seed), checked, and the
hint given when a repeat differs from what the server holds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from persia_py.config.table_policy import check_init_bounds, check_weight_bound
from persia_py.servers.optimizers import optimizer_from_dict, optimizer_to_dict

SETTINGS_KEYS = ("optimizer", "init_lower", "init_upper", "weight_bound", "seed")


@dataclass(frozen=True, kw_only=True)
class TableSettings:
    """What ``configure`` sets; identical repeats are accepted, conflicting ones refused."""

    optimizer: dict
    init_lower: float
    init_upper: float
    weight_bound: float | None
    seed: int


def checked_settings(**given: object) -> TableSettings:
    """Checked ``TableSettings`` from ``configure``'s arguments (or a checkpoint's copy of
    them); ValueError names the argument that is wrong."""
    if set(given) != set(SETTINGS_KEYS):
        raise ValueError(f"settings need exactly the keys {list(SETTINGS_KEYS)}, got "
                         f"{sorted(given)}")
    if not isinstance(given["optimizer"], dict):
        raise ValueError(f"optimizer must be a mapping, got {given['optimizer']!r}")
    opt = optimizer_from_dict(given["optimizer"])  # validates
    bounds = check_init_bounds(given["init_lower"], given["init_upper"],
                               "init_lower, init_upper")
    weight_bound = check_weight_bound(given["weight_bound"])
    seed = given["seed"]
    if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**64):
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    return TableSettings(
        optimizer=optimizer_to_dict(opt),
        init_lower=float(bounds[0]),
        init_upper=float(bounds[1]),
        weight_bound=weight_bound,
        seed=seed,
    )


def old_default_hint(held: TableSettings, asked: TableSettings) -> str:
    """What to do when two settings differ only in Adagrad's initial accumulator, whose
    default was PERSIA's 0.01 before it became torch's 0 (docs/porting_from_persia.md):
    a checkpoint written then holds 0.01."""
    values = {held.optimizer.get("initial_accumulator_value"),
              asked.optimizer.get("initial_accumulator_value")}
    same_else = (dataclasses.replace(held, optimizer={**held.optimizer,
                                                      "initial_accumulator_value": 0})
                 == dataclasses.replace(asked, optimizer={**asked.optimizer,
                                                          "initial_accumulator_value": 0}))
    if values != {0.0, 0.01} or not same_else:
        return ""
    return ("; they differ only in Adagrad's initial_accumulator_value, whose default was "
            "0.01 (PERSIA's) before persia_py took torch's 0: to go on from a checkpoint "
            "written then, pass Adagrad(..., initial_accumulator_value=0.01)")
