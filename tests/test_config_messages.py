"""One test per class of config error, asserting the exact message: the file, the key
path, what was expected and, for a misspelling, the closest valid key."""

from __future__ import annotations

import dataclasses

import pytest

from persia_py.config import (
    ConfigError,
    GlobalConfig,
    SlotConfig,
    load_embedding_config,
    load_global_config,
)

CASES = [  # (file, text, message after "<path>: ")
    # unknown / misspelled key
    ("global", "embedding_parameter_server_config:\n  capacty: 10\n",
     "embedding_parameter_server_config.capacty: unknown key (valid keys here: ['capacity', "
     "'disk_tier', 'num_hashmap_internal_shards']); did you mean 'capacity'?"),
    ("global", "common_confg: {}\n",
     "common_confg: unknown key (valid keys here: {GlobalConfig}); did you mean 'common_config'?"),
    ("embedding", "slots_config:\n  a:\n    dimm: 8\n",
     "slots_config.a.dimm: unknown key (valid keys here: {SlotConfig}); did you mean 'dim'?"),
    # wrong type
    ("global", "common_config:\n  rpc_timeout_sec: soon\n",
     "common_config.rpc_timeout_sec: expected float, got 'soon'"),
    ("global", "common_config:\n  job_type: Serve\n",
     "common_config.job_type: expected 'Train' or 'Infer', got 'Serve'"),
    ("embedding", "slots_config:\n  a:\n    dim: eight\n",
     "slots_config.a.dim: expected int, got 'eight'"),
    ("embedding", "slots_config:\n  a:\n    dim: 8\n    embedding_summation: 1\n",
     "slots_config.a.embedding_summation: expected bool, got 1"),
    # out of range
    ("global", "embedding_worker_config:\n  forward_buffer_size: 0\n",
     "embedding_worker_config.forward_buffer_size: 0 is out of range; expected 1 <= "
     "forward_buffer_size <= 1000000"),
    ("global", "common_config:\n  keepalive_sec: 0.2\n",
     "common_config.keepalive_sec: 0.2 is out of range; expected 1.0 <= keepalive_sec <= "
     "3600.0"),
    ("embedding", "slots_config:\n  a:\n    dim: 0\n",
     "slots_config.a.dim: 0 is out of range; expected 1 <= dim <= 65536"),
    # missing required key
    ("embedding", "slots_config:\n  a:\n    sqrt_scaling: true\n",
     "slots_config.a.dim: required key is missing"),
    ("embedding", "feature_index_prefix_bit: 8\n", "slots_config: required key is missing"),
]


@pytest.mark.parametrize("which, text, message", CASES)
def test_exact_message(tmp_path, which: str, text: str, message: str) -> None:
    path = tmp_path / f"{which}_config.yml"
    path.write_text(text)
    load = load_global_config if which == "global" else load_embedding_config
    # The lists of valid keys come from the schema, which grows.
    message = message.format(**{cls.__name__: sorted(f.name for f in dataclasses.fields(cls))
                                for cls in (GlobalConfig, SlotConfig)})
    with pytest.raises(ConfigError) as info:
        load(path)
    assert str(info.value) == f"{path}: {message}"


# -- checkpoint folders against the checkpoint root (persia_py.ops.start_checks) ---------------

RULE_DIR = ("it must be the root or a folder directly in it (ROOT or ROOT/NAME; its "
            "checkpoints are folders in it)")
RULE_INC = "it must be a folder in the root (ROOT/NAME or ROOT/NAME/NAME)"
ADVICE = ("The parameter servers read and write only inside the root: set "
          "checkpoint_config.root to a folder that holds it, or move it there")


@pytest.mark.parametrize("keys, message", [
    ({"dir": "/data/job/ckpt"},  # docs/online_training.md's example, started elsewhere
     "checkpoint_config.dir: '/data/job/ckpt' lies outside the checkpoint root {root} "
     "(checkpoint_config.root is unset: the current directory); " + RULE_DIR),
    ({"root": "{root}", "dir": "{root}/a/b"},
     "checkpoint_config.dir: '{root}/a/b' lies too deep in the checkpoint root {root} "
     "(checkpoint_config.root); " + RULE_DIR),
    ({"root": "{root}", "dir": "{root}/my ckpt"},
     "checkpoint_config.dir: '{root}/my ckpt' has 'my ckpt', not a plain name (letters, "
     "digits, '_', '.', '-'), on its way from the checkpoint root {root} "
     "(checkpoint_config.root); " + RULE_DIR),
    ({"root": "{root}", "dir": "{root}", "incremental_dir": "{root}"},
     "checkpoint_config.incremental_dir: '{root}' is the checkpoint root {root} "
     "(checkpoint_config.root); " + RULE_INC),
    ({"root": "{root}/ckpt", "dir": "{root}/ckpt", "incremental_dir": "{root}/increments"},
     "checkpoint_config.incremental_dir: '{root}/increments' lies outside the checkpoint "
     "root {root}/ckpt (checkpoint_config.root); " + RULE_INC),
])
def test_checkpoint_folders_outside_the_root_are_named_with_the_rule(
        tmp_path, monkeypatch, keys: dict, message: str) -> None:
    from persia_py.config import CheckpointConfig
    from persia_py.ops.start_checks import check_checkpoint_paths

    monkeypatch.chdir(tmp_path)  # the root when checkpoint_config.root is unset
    root = str(tmp_path.resolve())
    config = CheckpointConfig(**{k: v.format(root=root) for k, v in keys.items()})
    with pytest.raises(ConfigError) as info:
        check_checkpoint_paths(config)
    assert str(info.value) == f"{message.format(root=root)}. {ADVICE}"
    allowed = CheckpointConfig(root=root, dir=f"{root}/ckpt", incremental_dir=f"{root}/ckpt/inc")
    check_checkpoint_paths(allowed)
    check_checkpoint_paths(dataclasses.replace(allowed, dir=root))  # the root itself


def test_a_checkpoint_root_that_is_a_file_is_refused(tmp_path) -> None:
    from persia_py.config import CheckpointConfig
    from persia_py.ops.start_checks import check_checkpoint_paths

    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError) as info:
        check_checkpoint_paths(CheckpointConfig(root=str(tmp_path / "a-file")))
    assert str(info.value) == (f"checkpoint_config.root: '{tmp_path / 'a-file'}' "
                               "(checkpoint_config.root) is a file; the checkpoint root must "
                               "be a folder")


def test_kubernetes_pods_are_checked_in_their_working_folder() -> None:
    from persia_py.config import CheckpointConfig
    from persia_py.ops.start_checks import check_checkpoint_paths

    check_checkpoint_paths(CheckpointConfig(dir="ckpt", incremental_dir="/app/ckpt/inc"),
                           pod_dir="/app")
    with pytest.raises(ConfigError, match=r"^checkpoint_config.dir: '/data/job/ckpt' lies "
                                          r"outside the checkpoint root /app \("):
        check_checkpoint_paths(CheckpointConfig(dir="/data/job/ckpt"), pod_dir="/app")


# -- folders a role writes (persia_py.ops.start_checks.check_writable) -----------------------
# A folder the role's user cannot write: tests/test_start_checks.py (real processes).


def test_trying_a_folder_leaves_nothing_behind_and_makes_no_folder(tmp_path) -> None:
    from persia_py.ops.start_checks import Written, check_writable

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "old.log").write_text("kept\n")
    check_writable([Written(tmp_path, "a"), Written(tmp_path / "x" / "y", "b"),
                    Written(tmp_path / "logs" / "old.log", "c", file=True),
                    Written(tmp_path / "logs" / "new.log", "d", file=True)])
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["logs", "old.log"]
    assert (tmp_path / "logs" / "old.log").read_text() == "kept\n"


def test_what_cannot_be_a_folder_or_a_log_is_named_each_with_its_key(tmp_path) -> None:
    import os
    import pwd

    from persia_py.ops.start_checks import Written, check_writable

    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-folder").mkdir()
    with pytest.raises(ConfigError) as info:
        check_writable([Written(tmp_path / "a-file" / "ckpt", "checkpoint_config.dir"),
                        Written(tmp_path / "a-folder", "--train-log", file=True),
                        Written(tmp_path / "fine", "checkpoint_config.incremental_dir")])
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name} (uid {os.geteuid()})"
    assert str(info.value) == (
        f"checkpoint_config.dir: '{tmp_path}/a-file/ckpt' cannot be written by {user}: "
        f"'{tmp_path}/a-file' is a file, not a folder\n"
        f"--train-log: '{tmp_path}/a-folder' cannot be written by {user}: it is a folder, "
        "not a file\n"
        "The job writes there: make each writable for that user (chown, chmod, or the "
        "volume's owner or mount options), or configure a folder it can write")


def test_each_role_tries_only_what_it_writes(tmp_path) -> None:
    """A checkpoint root that exists is not tried (a job may only load from it); one
    that is missing is (a server makes it); an export folder only while exporting."""
    from persia_py.config import CheckpointConfig
    from persia_py.ops.start_checks import Written, written_by_servers, written_by_training

    root, missing = str(tmp_path), str(tmp_path / "missing")
    assert written_by_servers(CheckpointConfig(root=root)) == []
    assert written_by_servers(CheckpointConfig(root=missing)) == [
        Written(missing, "checkpoint_config.root")]
    assert written_by_servers(CheckpointConfig(root=root), root=missing) == [
        Written(missing, "--checkpoint-root")]
    both = CheckpointConfig(root=root, dir=f"{root}/ckpt", incremental_dir=f"{root}/inc",
                            dense_export_dir=f"{root}/dense")
    assert written_by_servers(both) == [Written(f"{root}/ckpt", "checkpoint_config.dir")]
    assert written_by_training(both) == [Written(f"{root}/ckpt", "checkpoint_config.dir")]
    exporting = dataclasses.replace(both, incremental_every_sec=10.0,
                                    dense_export_every_steps=100)
    assert written_by_servers(exporting)[1:] == [
        Written(f"{root}/inc", "checkpoint_config.incremental_dir")]
    assert written_by_training(exporting)[1:] == [
        Written(f"{root}/dense", "checkpoint_config.dense_export_dir")]
