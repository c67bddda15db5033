"""Shared volumes of a Kubernetes job: ReadWriteMany PersistentVolumeClaims mounted in
every pod (``persia-launcher k8s --shared-volume CLAIM:PATH``), and the check that every
folder that must outlive a pod, or that another pod reads, lies on one.

A pod's own filesystem dies with it, and each pod has its own: a checkpoint written there
could not be resumed (each parameter server and the NN worker would hold a part) nor
served, a stream's position log would be lost and with it exactly-once. With a shared
volume the roles' own logs move onto it too (a parameter server's update log, a data
loader's handover log, the training log), so a pod deleted and started again, on any
node, replays them as a container restarted in its pod does.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from persia_py.config import ConfigError
from persia_py.launcher.job_model import Folder

__all__ = ["SharedVolume", "check_on_shared_volumes", "parse_shared_volume"]


@dataclass(frozen=True)
class SharedVolume:
    """A ReadWriteMany PersistentVolumeClaim ``claim`` mounted at ``path`` in every pod."""

    claim: str
    path: str

    @property
    def volume_name(self) -> str:
        return f"shared-{self.claim}"[:63]

    def holds(self, path: str) -> bool:
        """Whether ``path`` (absolute, as the pods see it) lies on this volume."""
        return posixpath.commonpath([self.path, posixpath.normpath(path)]) == self.path


def parse_shared_volume(text: str) -> SharedVolume:
    """``CLAIM:PATH`` (SystemExit naming the flag unless a claim name and an absolute path)."""
    claim, sep, path = text.partition(":")
    if not sep or not claim or not path.startswith("/") or path == "/":
        raise SystemExit(f"--shared-volume {text!r}: expected CLAIM:PATH, a "
                         "PersistentVolumeClaim's name and the absolute path (not /) to mount "
                         "it at in every pod")
    return SharedVolume(claim, posixpath.normpath(path))


def check_on_shared_volumes(folders: list[Folder], volumes: tuple[SharedVolume, ...],
                            pod_dir: str) -> None:
    """ConfigError naming every folder that must outlive a pod or that other pods read,
    and lies on none of ``volumes`` (a relative path is in ``pod_dir``), with the flag
    that fixes it."""
    problems = []
    for folder in folders:
        if not (folder.shared or folder.outlives_process):
            continue
        path = posixpath.normpath(posixpath.join(pod_dir, folder.path))
        if any(v.holds(path) for v in volumes):
            continue
        writers = ", ".join(sorted(k.title for k in folder.writers))
        problems.append(f"{folder.source}: {path} lies on no shared volume, but {writers} "
                        "pods write it and "
                        + ("other pods read it" if folder.shared else "their restarts read it")
                        + "; each pod would write into its own filesystem, lost with the pod")
    if problems:
        mounted = (", ".join(f"{v.claim} at {v.path}" for v in volumes) if volumes
                   else "none")
        raise ConfigError("\n".join(problems) + f"\nshared volumes: {mounted}. Mount a "
                          "ReadWriteMany PersistentVolumeClaim where they lie with "
                          "--shared-volume CLAIM:PATH (and set checkpoint_config.root and "
                          "its folders under PATH)")
