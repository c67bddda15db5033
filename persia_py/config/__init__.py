"""The two config files, ``global_config.yml`` and ``embedding_config.yml``, read strictly.

Key names follow PERSIA's. Unlike PERSIA, an unknown or misspelled key, a wrong type or
an out-of-range value stops the process with a :class:`ConfigError` naming the file, the
key path, what was expected and, for a misspelling, the closest valid key. Each section
is a keyword-only dataclass; its field docstrings are the reference.

The package's modules: argument checks every public class uses (:mod:`.checks`), the
optimizer and table-policy rules the API, the files and the servers share
(:mod:`.optimizer`, :mod:`.table_policy`), and the strict YAML loading (:mod:`.strict`).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from persia_py.config.checks import check_number
from persia_py.config.optimizer import optimizer_from_dict
from persia_py.config.strict import ConfigError, build, load_file
from persia_py.config.table_policy import TablePolicy

__all__ = [
    "CheckpointConfig", "CommonConfig", "ConfigError", "DiskTierConfig", "EmbeddingTablesConfig",
    "EmbeddingWorkerConfig", "GlobalConfig", "HashStackConfig", "NNWorkerConfig",
    "ParameterServerConfig", "SlotConfig", "embedding_config_from_dict",
    "global_config_from_dict", "load_embedding_config", "load_global_config",
]

RowDtype = Literal["float32", "float16", "bfloat16"]
"""The storage types of rows a config file may name: those registered in
``persia_py.servers.row_types.ROW_TYPES`` (tests/test_registries.py holds them equal)."""


@dataclass(kw_only=True, frozen=True)
class CommonConfig:
    job_type: Literal["Train", "Infer"] = "Train"
    """``Train`` or ``Infer``."""
    max_message_bytes: int = 512 * 1024 * 1024
    """Largest gRPC message sent or received, on every channel and server; also the most
    bytes a received request may decompress to (lz4 payloads, checked before decoding)."""
    max_control_message_bytes: int = 1024 * 1024
    """Largest request a server accepts for a call that carries no arrays (Configure,
    Stats, Health, checkpoint calls, a lookup by ref); checked before parsing."""
    rpc_timeout_sec: float = 120.0
    """Deadline of every RPC; idempotent calls are retried until it passes."""
    keepalive_sec: float = 10.0
    """How often a client with calls in flight pings its server, and how long it waits for
    the answer before giving the connection up: a peer behind a dead link (cable pulled,
    host gone) then fails its calls UNAVAILABLE within about twice this, and idempotent
    ones retry on a new connection, instead of waiting out their deadline. Servers accept
    pings this often. Shorter finds dead links sooner at the cost of more pings, and of
    false alarms where a busy host answers pings late."""
    startup_timeout_sec: float = 300.0
    """How long a role waits for the services it depends on to come up."""
    embedding_fp16: bool = False
    """Embeddings and their gradients travel as float16 (half the bytes; the servers
    keep and update float32)."""
    lz4_compression: bool = False
    """Embedding and gradient payloads travel lz4-compressed."""
    shared_memory: bool = True
    """An NN worker and an embedding worker on the same host, and an embedding worker and
    a parameter server on the same host, pass lookup answers and gradients through shared
    memory (``/dev/shm``) instead of inside the messages; the calls stay gRPC calls.
    Where the two are not on one host (or ``/dev/shm`` fails) the arrays travel in the
    messages, as with ``false``."""
    tls_cert_file: str | None = None
    """PEM certificate this role presents, as a server and as a client (mutual TLS). With
    ``tls_key_file`` and ``tls_ca_file`` set, every server refuses plaintext connections
    and peers without a certificate signed by the CA. Set all three or none."""
    tls_key_file: str | None = None
    """PEM private key of ``tls_cert_file``."""
    tls_ca_file: str | None = None
    """PEM certificate of the CA that signed every role's certificate; peers are checked
    against it."""
    auth_token_file: str | None = None
    """File holding the job's shared token (one line, at least 16 printable characters).
    Unset: the token comes from the environment variable ``PERSIA_AUTH_TOKEN``, if set.
    With a token, every server refuses calls that do not carry it (UNAUTHENTICATED)."""

    def __post_init__(self) -> None:
        _check_range(self, "max_message_bytes", 4 * 1024 * 1024, 2**31 - 1)
        _check_range(self, "max_control_message_bytes", 64 * 1024, 2**31 - 1)
        _check_range(self, "rpc_timeout_sec", 0.1, 86400.0)
        _check_range(self, "startup_timeout_sec", 1.0, 86400.0)
        _check_range(self, "keepalive_sec", 1.0, 3600.0)
        tls = ("tls_cert_file", "tls_key_file", "tls_ca_file")
        given = [name for name in tls if getattr(self, name) is not None]
        if given and len(given) != len(tls):
            raise ConfigError(f"{', '.join(given)}: TLS needs all of {', '.join(tls)} (every "
                              f"role is a server and a client), or none")
        for name in (*tls, "auth_token_file"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{name}: {path!r} is not a readable file")


@dataclass(kw_only=True, frozen=True)
class DiskTierConfig:
    """A disk tier under every internal shard of every table (off unless ``path`` is set):
    rows evicted from RAM at ``capacity`` go to a file on local disk instead of being
    deleted, and come back into RAM when looked up or updated
    (``persia_py.servers.disk_tier``)."""

    path: str | None = None
    """Existing folder on a local disk for the tier's files (unnamed: nothing is left in
    it after the process ends, and the tier always starts empty). None: no tier."""
    capacity_rows: int = 0
    """Most rows on disk per table per replica (split evenly among the internal shards);
    when full, the rows spilled longest ago are deleted (counted as evicted). Its disk
    space is reserved at start: about ``capacity_rows / (1 - free_fraction) x 512 /
    (512 // record bytes)`` bytes (a record: 8 + dim x bytes per weight + 4 x optimizer
    state columns)."""
    free_fraction: float = 1 / 8
    """Share of the tier's file kept free beyond ``capacity_rows``, so that making room
    for a spill moves at most ``(1 - free_fraction) / free_fraction`` rows already on
    disk per row spilled (7 at the default, 2 at 1/3; about 1.4 under Zipf(1.05) ids
    at the default), however full the disk is; lower trades write work for disk space (0: the
    file holds exactly ``capacity_rows``, and a nearly full disk moves many rows per
    spill). In [0, 0.9]."""
    expire_after_steps: int | None = None
    """The disk's own TTL: a row on disk unused (no lookup, no update) for the last that
    many lookup calls on its table is deleted, counted as expired. None: no TTL."""
    expire_after_seconds: float | None = None
    """As ``expire_after_steps``, in seconds (None: no TTL)."""
    spill_expired: bool = False
    """A slot's own TTL (its ``expire_after_*``), False: removes the row wherever it is,
    RAM or disk; True: moves a row expiring in RAM to disk, where only the disk's TTL and
    capacity delete rows."""

    def __post_init__(self) -> None:
        if self.path is None:
            for name in ("capacity_rows", "expire_after_steps", "expire_after_seconds",
                         "spill_expired"):
                if getattr(self, name):
                    raise ConfigError(f"{name}: set, but path is not; set path (a folder on a "
                                      f"local disk) to turn the disk tier on, or drop {name}")
            return
        if not self.path:
            raise ConfigError("path: empty; give a folder on a local disk, or leave path out")
        if not self.capacity_rows:
            raise ConfigError("capacity_rows: required (>= 1) when path is set")
        _check_range(self, "capacity_rows", 1, 2**40)
        _check_range(self, "free_fraction", 0.0, 0.9)
        try:  # the same rules as a slot's TTL
            TablePolicy(expire_after_steps=self.expire_after_steps,
                        expire_after_seconds=self.expire_after_seconds)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not os.path.isdir(self.path):
            raise ConfigError(f"path: {self.path!r} is not an existing folder")

    @property
    def enabled(self) -> bool:
        return self.path is not None


@dataclass(kw_only=True, frozen=True)
class ParameterServerConfig:
    capacity: int | None = None
    """Most rows one parameter-server replica holds per table; beyond it the least
    recently used rows are evicted. A slot's own ``capacity`` takes precedence. Unset:
    as many as the replica's memory allows (``persia_py.servers.sizing.derived_capacity``:
    the tables, full, take at most half of its cgroup's limit or the machine's memory)."""
    num_hashmap_internal_shards: int = 1
    """Internal shards per table; shards are locked and served independently."""
    disk_tier: DiskTierConfig = field(default_factory=DiskTierConfig)
    """Rows evicted at ``capacity`` spill to local disk instead of being deleted (off by
    default: see :class:`DiskTierConfig`)."""

    def __post_init__(self) -> None:
        if self.capacity is not None:
            _check_range(self, "capacity", 1, 2**62)
        _check_range(self, "num_hashmap_internal_shards", 1, 4096)


@dataclass(kw_only=True, frozen=True)
class EmbeddingWorkerConfig:
    forward_buffer_size: int = 1000
    """Batches an embedding worker holds (received from data loaders, or looked up and
    awaiting gradients). When full, data loaders wait; nothing is dropped."""

    max_buffer_bytes: int = 1 << 30
    """Bytes of ID features an embedding worker holds for batches not yet trained; when
    full, data loaders wait."""

    def __post_init__(self) -> None:
        _check_range(self, "forward_buffer_size", 1, 1_000_000)
        _check_range(self, "max_buffer_bytes", 1, 2**50)


@dataclass(kw_only=True, frozen=True)
class NNWorkerConfig:
    max_buffer_bytes: int = 1 << 30
    """Bytes an NN worker holds for batches looked up but not yet trained and for
    embedding gradients not yet acknowledged; when full, lookups wait."""
    fsdp_max_unsharded_bytes: int | None = None
    """Under ``FSDPOption``: most bytes of gathered dense parameters alive at once on a
    rank (the rate limiter), when the option sets no ``max_unsharded_bytes`` of its own
    (the option wins: the training script knows its tower). Here so that the job's
    config can size it per deployment without editing the script; None: no bound."""

    def __post_init__(self) -> None:
        _check_range(self, "max_buffer_bytes", 1, 2**50)
        if self.fsdp_max_unsharded_bytes is not None:
            _check_range(self, "fsdp_max_unsharded_bytes", 1, 2**50)


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    root: str | None = None
    """The folder every checkpoint and incremental export of the job lives in. Each
    parameter server reads and writes only inside it (checkpoint calls name folders in
    it, never paths); ``dir``, ``incremental_dir`` and the folders given to
    ``dump_checkpoint`` / ``load_checkpoint`` must be it or lie directly in it. Unset:
    the current directory of each process (``persia-launcher local`` starts every role
    in the directory it was started in)."""
    dir: str | None = None
    """Checkpoint root that ``TrainCtx`` writes periodic and final checkpoints to and
    resumes from (none: off); ``root`` or a folder directly in it."""
    every_steps: int = 0
    """Checkpoint after every this many steps of the job (0: never)."""
    incremental_dir: str | None = None
    """Folder each training parameter server writes incremental exports to (the rows
    inserted or updated since its last export), for serving replicas that follow them;
    a folder in ``root``."""
    incremental_every_updates: int = 0
    """Export after this many applied updates (requests) of a replica (0: not by count)."""
    incremental_every_sec: float = 0.0
    """Export once this many seconds have passed since a replica's last export (0: not
    by time). A serving replica following the exports warns when its newest applied one
    is older than twice this."""
    dense_export_dir: str | None = None
    """Folder rank 0 of a training job writes versions of the dense model to, for
    serving processes that follow them (``serve --follow-dense``)."""
    dense_export_every_steps: int = 0
    """Export the dense model after every this many training steps (0: not by steps)."""
    dense_export_every_sec: float = 0.0
    """Export the dense model once this many seconds have passed since the last version
    (0: not by time). A serving process following them warns when its model is older
    than twice this."""

    def __post_init__(self) -> None:
        for key in ("every_steps", "incremental_every_updates", "dense_export_every_steps"):
            _check_range(self, key, 0, 2**40)
        for key in ("incremental_every_sec", "dense_export_every_sec"):
            _check_range(self, key, 0.0, 86400.0 * 365)
        _folder_for(self, "dir", "every_steps")
        _folder_for(self, "incremental_dir", "incremental_every_updates", "incremental_every_sec")
        _folder_for(self, "dense_export_dir", "dense_export_every_steps", "dense_export_every_sec")


def _folder_for(config: object, folder: str, *periods: str) -> None:
    """The folder key is required when any period that writes into it is set."""
    if any(getattr(config, p) for p in periods) and not getattr(config, folder):
        raise ConfigError(f"{folder}: required when {' or '.join(periods)} > 0")


@dataclass(kw_only=True, frozen=True)
class GlobalConfig:
    common_config: CommonConfig = field(default_factory=CommonConfig)
    """Settings every role reads."""
    embedding_parameter_server_config: ParameterServerConfig = field(
        default_factory=ParameterServerConfig
    )
    """Settings of the embedding parameter servers."""
    embedding_worker_config: EmbeddingWorkerConfig = field(default_factory=EmbeddingWorkerConfig)
    """Settings of the embedding workers."""
    nn_worker_config: NNWorkerConfig = field(default_factory=NNWorkerConfig)
    """Settings of the NN workers."""
    checkpoint_config: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Periodic checkpoints of training (``TrainCtx.dump_checkpoint``)."""


@dataclass(kw_only=True, frozen=True)
class HashStackConfig:
    hash_stack_rounds: int = 0
    """Hash each raw id this many times (0: off); its embedding is the sum of the rows of
    the ``hash_stack_rounds`` buckets, so the slot's table holds at most
    ``hash_stack_rounds * embedding_size`` rows however many distinct ids arrive."""
    embedding_size: int = 0
    """Buckets per round (required when ``hash_stack_rounds`` > 0)."""

    def __post_init__(self) -> None:
        _check_range(self, "hash_stack_rounds", 0, 64)
        _check_range(self, "embedding_size", 0, 2**40)
        if self.hash_stack_rounds and not self.embedding_size:
            raise ConfigError("embedding_size: required (>= 1) when hash_stack_rounds > 0")
        if self.embedding_size and not self.hash_stack_rounds:
            raise ConfigError("hash_stack_rounds: 0 (off), but embedding_size is set; set both "
                              "or neither")

    @property
    def rounds(self) -> int:
        """Rows summed per id: ``hash_stack_rounds``, or 1 when hash stacking is off."""
        return self.hash_stack_rounds or 1


@dataclass(kw_only=True, frozen=True)
class SlotConfig:
    dim: int
    """Embedding dimension of the slot (required)."""
    embedding_summation: bool = True
    """Pool a sample's ids into one vector (``true``) or hand the model the raw sequence
    ``[batch, sample_fixed_size, dim]`` (``false``)."""
    pooling: Literal["sum", "mean"] = "sum"
    """How ids are pooled when ``embedding_summation`` is true."""
    sqrt_scaling: bool = False
    """Divide a pooled sum by the square root of the sample's id count."""
    sample_fixed_size: int = 10
    """Padded length of a raw sequence. A longer sample is an error, never truncated."""
    capacity: int | None = None
    """Most rows of this slot per parameter-server replica (default: the global one)."""
    admit_probability: float = 1.0
    """In (0, 1]: each time a training lookup meets an id the table lacks, the id is stored
    with this probability (a hash of the id, the seed and the table's step, so reruns
    choose alike); an id not stored reads as zeros and its gradient is dropped (PERSIA)."""
    min_occurrences: int = 1
    """Store a new id only from the training lookup that sees it for this many times
    (1 to 255; counted in a count-min sketch per shard, so collisions may admit a rare
    id a little early); before that it reads as zeros and its gradient is dropped."""
    expire_after_steps: int | None = None
    """Remove rows neither looked up nor updated during this many lookup calls on the
    table (default: never)."""
    expire_after_seconds: float | None = None
    """Remove rows neither looked up nor updated for this many seconds (default: never)."""
    row_dtype: RowDtype | None = None
    """How this slot's rows are stored on the parameter servers: ``float32``, ``float16``
    (half the bytes of weights; magnitudes up to 65504) or ``bfloat16`` (half the bytes;
    float32's range, 8 bits of precision); default: the file's ``row_dtype``. Updates are
    computed in float32 and rounded back stochastically; optimizer state stays float32."""
    optimizer: dict[str, Any] | None = None
    """This slot's embedding optimizer, overriding the one ``TrainCtx`` sends, e.g.
    ``{type: adam, lr: 0.001}`` (keys of ``SGD``/``Adagrad``/``Adam``; default: that one)."""
    hash_stack_config: HashStackConfig = field(default_factory=HashStackConfig)
    """PERSIA's hash stacking: many raw ids share a few rows (default: off)."""

    def __post_init__(self) -> None:
        _check_range(self, "dim", 1, 65536)
        _check_range(self, "sample_fixed_size", 1, 1_000_000)
        try:
            TablePolicy(capacity=self.capacity, admit_probability=self.admit_probability,
                        min_occurrences=self.min_occurrences,
                        expire_after_steps=self.expire_after_steps,
                        expire_after_seconds=self.expire_after_seconds)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.optimizer is not None:
            try:
                optimizer_from_dict(self.optimizer)
            except ValueError as exc:
                raise ConfigError(f"optimizer: {exc}") from None

    @property
    def pooling_mode(self) -> str:
        """``sum``, ``mean`` or ``raw``."""
        return self.pooling if self.embedding_summation else "raw"


@dataclass(kw_only=True, frozen=True)
class EmbeddingTablesConfig:
    """``embedding_config.yml``: the slots and the tables that hold them. (The user's
    :class:`persia_py.embedding.EmbeddingConfig`, as in PERSIA, is another thing: the
    initialization and weight bound a training job sends.)"""

    slots_config: dict[str, SlotConfig]
    """One entry per ID-type feature (slot), by name."""
    feature_index_prefix_bit: int = 0
    """High bits of every id replaced by the 1-based index of the slot's feature group
    (groups of ``feature_groups`` first, then every other slot as a group of its own, in
    file order), so equal raw ids of different groups never collide; 0 disables it."""
    feature_groups: dict[str, list[str]] = field(default_factory=dict)
    """Group name -> slots. The slots of a group share one table (named after the group)
    and one id prefix, so an id means the same row in each of them; they must have equal
    ``dim`` and ``capacity``. A slot is in at most one group; a slot in none is a group of
    its own, named after the slot."""
    row_dtype: RowDtype = "float32"
    """Storage type of every slot's rows that does not set its own ``row_dtype``."""
    stochastic_rounding: bool = True
    """Round updates of float16/bfloat16 rows stochastically (unbiased). ``false`` rounds
    to nearest, which loses every update under half a unit in the last place: only for
    measuring what stochastic rounding buys."""
    _group_of: dict[str, str] = field(init=False, repr=False, compare=False)
    """Derived in ``__post_init__``: slot -> the table that holds it (not a config key)."""
    _tables: dict[str, list[str]] = field(init=False, repr=False, compare=False)
    """Derived in ``__post_init__``: what :attr:`tables` returns (not a config key)."""

    def __post_init__(self) -> None:
        if not self.slots_config:
            raise ConfigError("slots_config: at least one slot is required")
        _check_range(self, "feature_index_prefix_bit", 0, 16)
        self._check_feature_groups()
        num_groups = len(self.tables)
        if self.feature_index_prefix_bit and num_groups >= 2**self.feature_index_prefix_bit:
            raise ConfigError(
                f"feature_index_prefix_bit: {self.feature_index_prefix_bit} bits cannot number "
                f"{num_groups} feature groups (every slot outside feature_groups is one)"
            )

    def _check_feature_groups(self) -> None:
        group_of: dict[str, str] = {}
        for group, slots in self.feature_groups.items():
            if not slots:
                raise ConfigError(f"feature_groups.{group}: a group needs at least one slot")
            for name in slots:
                if name not in self.slots_config:
                    close = difflib.get_close_matches(name, list(self.slots_config), n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    raise ConfigError(f"feature_groups.{group}: unknown slot {name!r} (slots: "
                                      f"{sorted(self.slots_config)}){hint}")
                if name in group_of:
                    where = ("twice in this group" if group_of[name] == group
                             else f"also in group {group_of[name]!r}")
                    raise ConfigError(f"feature_groups.{group}: slot {name!r} is {where}; a "
                                      "slot belongs to at most one group")
                group_of[name] = group
            for key in _TABLE_KEYS:
                values = {name: getattr(self.slots_config[name], key) for name in slots}
                if any(v != values[slots[0]] for v in values.values()):  # may be unhashable
                    raise ConfigError(
                        f"feature_groups.{group}: slots {slots} share one table, so their {key} "
                        f"must be equal; got {values}"
                    )
        for name in self.slots_config:
            if name not in group_of and name in self.feature_groups:
                raise ConfigError(f"feature_groups.{name}: the group is named like slot {name!r}, "
                                  "which is not in it (that slot's own table has this name)")
            group_of.setdefault(name, name)
        # Frozen dataclass: cache the derived mappings once, here.
        tables = {g: list(s) for g, s in self.feature_groups.items()}
        for name, group in group_of.items():
            tables.setdefault(group, [name])
        object.__setattr__(self, "_group_of", group_of)
        object.__setattr__(self, "_tables", tables)

    @property
    def tables(self) -> dict[str, list[str]]:
        """Table name -> its slots: each feature group, then each slot outside the groups."""
        return self._tables

    def table_of(self, slot: str) -> str:
        """Name of the parameter-server table that holds slot ``slot``'s rows."""
        self.slot(slot)
        return self._group_of[slot]

    def slot(self, name: str) -> SlotConfig:
        """The config of slot ``name``; ValueError naming the known slots if absent."""
        try:
            return self.slots_config[name]
        except KeyError:
            raise ValueError(
                f"unknown slot {name!r}; embedding_config has {sorted(self.slots_config)}"
            ) from None

    def row_dtype_of(self, table: str) -> str:
        """Storage type of table ``table``'s rows (its slots agree on it)."""
        slot = self.slots_config[self.tables[table][0]]
        return slot.row_dtype or self.row_dtype

    def slot_prefix(self, name: str) -> int:
        """The prefix value of slot ``name``: its feature group's 1-based index (0: off)."""
        if not self.feature_index_prefix_bit:
            return 0
        return list(self.tables).index(self.table_of(name)) + 1


_TABLE_KEYS = ("dim", "capacity", "admit_probability", "min_occurrences", "expire_after_steps",
               "expire_after_seconds", "optimizer", "row_dtype")
"""SlotConfig keys that describe the table itself: equal across the slots of a group."""


def _check_range(obj: Any, name: str, low: float, high: float) -> None:
    try:
        check_number(name, getattr(obj, name), low=low, high=high)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def load_global_config(path: str | os.PathLike | None) -> GlobalConfig:
    """Read ``global_config.yml``; ``None`` gives every default."""
    return GlobalConfig() if path is None else load_file(GlobalConfig, path)


def load_embedding_config(path: str | os.PathLike) -> EmbeddingTablesConfig:
    """Read ``embedding_config.yml``."""
    return load_file(EmbeddingTablesConfig, path)


def global_config_from_dict(data: dict) -> GlobalConfig:
    """Build a GlobalConfig from a mapping, with the same checks as a file."""
    return build(GlobalConfig, data, "")


def embedding_config_from_dict(data: dict) -> EmbeddingTablesConfig:
    """Build an EmbeddingTablesConfig from a mapping, with the same checks as a file."""
    return build(EmbeddingTablesConfig, data, "")
