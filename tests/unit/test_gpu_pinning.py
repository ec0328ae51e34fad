"""`dlrm.distributed.devices.pin_gpu` through the collectives that call it: one
GPU per rank, a clear error with fewer GPUs than ranks, the first GPU for one
process, and a new world after an elastic reset keeping the GPU it had.

The machines are CPU-only, so the host's GPUs are faked: TensorFlow's device
configuration as pinning uses it, down to its refusal to change the visible
devices once the runtime has started."""

from __future__ import annotations

import socket
import sys
import types
from collections.abc import Callable
from typing import Any

import horovod
import pytest
import tensorflow as tf

from dlrm.distributed import collectives, devices
from dlrm.distributed.launcher import RANK_VARIABLES


class FakeHost:
    """TensorFlow's view of a host with `gpus` GPUs: what is visible, which GPUs
    grow their memory, and whether the runtime has started (then, as in
    TensorFlow, a change raises RuntimeError and setting the same is a no-op)."""

    def __init__(self, gpus: int) -> None:
        self.cpu = tf.config.PhysicalDevice("/physical_device:CPU:0", "CPU")
        self.gpus = [
            tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(gpus)
        ]
        self.visible = [self.cpu, *self.gpus]
        self.growth: dict[Any, bool] = {}
        self.started = False

    def list_physical_devices(self, device_type: str | None = None) -> list[Any]:
        return [d for d in [self.cpu, *self.gpus] if device_type in (None, d.device_type)]

    def set_visible_devices(self, devices: Any, device_type: str | None = None) -> None:
        devices = devices if isinstance(devices, list) else [devices]
        kept = [d for d in self.visible if device_type is not None and d.device_type != device_type]
        if kept + devices == self.visible:
            return
        if self.started:
            raise RuntimeError("Visible devices cannot be modified after being initialized")
        self.visible = kept + devices

    def set_memory_growth(self, device: Any, enable: bool) -> None:
        if self.growth.get(device) == enable:
            return
        if self.started:
            raise RuntimeError("Physical devices cannot be modified after being initialized")
        self.growth[device] = enable

    def visible_gpus(self) -> list[str]:
        return [d.name for d in self.visible if d.device_type == "GPU"]


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], FakeHost]:
    """A fresh process (nothing pinned yet) on a host with the given GPU count."""
    monkeypatch.setattr(devices, "_pinned", None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # A rank's CPU share is not what these tests are about, and would bind this process.
    monkeypatch.setattr(collectives, "share_cpus", lambda *args: (None, None))

    def make(gpus: int) -> FakeHost:
        fake = FakeHost(gpus)
        monkeypatch.setattr(tf.config, "list_physical_devices", fake.list_physical_devices)
        monkeypatch.setattr(tf.config, "set_visible_devices", fake.set_visible_devices)
        monkeypatch.setattr(tf.config.experimental, "set_memory_growth", fake.set_memory_growth)
        return fake

    return make


@pytest.fixture
def horovod_ranks(monkeypatch: pytest.MonkeyPatch) -> Callable[[int, int], Any]:
    """`rank(local_rank, local_size)`: `HorovodCollectives` as a new world builds
    it (`ElasticMembership.collectives`), on a fake Horovod that says this rank
    is `local_rank` of `local_size` on its host."""
    where = {"local_rank": 0, "local_size": 1}
    fake = types.SimpleNamespace(
        rank=lambda: where["local_rank"],
        size=lambda: where["local_size"],
        local_rank=lambda: where["local_rank"],
        local_size=lambda: where["local_size"],
    )
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", fake)
    monkeypatch.setattr(horovod, "tensorflow", fake, raising=False)

    def rank(local_rank: int, local_size: int) -> collectives.HorovodCollectives:
        where.update(local_rank=local_rank, local_size=local_size)
        return collectives.HorovodCollectives(bind_cpus=False, initialize=False)

    return rank


def new_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_pinned", None)


@pytest.mark.parametrize("local_rank", [0, 3])
def test_more_ranks_than_gpus_on_a_host_is_an_error_that_says_what_to_do(
    host: Callable[[int], FakeHost], horovod_ranks: Callable[[int, int], Any], local_rank: int
) -> None:
    fake = host(2)
    with pytest.raises(devices.DeviceError) as raised:
        horovod_ranks(local_rank, 4)
    message = str(raised.value)
    for part in (
        socket.gethostname(),
        "4 ranks on this host (hvd.local_size())",
        "sees 2 GPUs",
        f"local rank {local_rank}",
        "-H host:N",
        "--ntasks-per-node=N",
        "CUDA_VISIBLE_DEVICES",
    ):
        assert part in message
    assert fake.visible_gpus() == ["/physical_device:GPU:0", "/physical_device:GPU:1"]
    assert fake.growth == {}


def test_two_ranks_on_one_gpu_without_a_launcher_choosing_are_an_error(
    host: Callable[[int], FakeHost], horovod_ranks: Callable[[int, int], Any]
) -> None:
    host(1)
    with pytest.raises(devices.DeviceError, match="sees 1 GPU, so local rank 1"):
        horovod_ranks(1, 2)


def test_each_of_two_ranks_sees_its_own_of_two_gpus(
    host: Callable[[int], FakeHost],
    horovod_ranks: Callable[[int, int], Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for local_rank in (0, 1):
        new_process(monkeypatch)
        fake = host(2)
        horovod_ranks(local_rank, 2)
        gpu = f"/physical_device:GPU:{local_rank}"
        assert fake.visible_gpus() == [gpu]
        assert {d.name: grows for d, grows in fake.growth.items()} == {gpu: True}


def test_a_rank_the_launcher_gave_one_gpu_pins_it(
    host: Callable[[int], FakeHost],
    horovod_ranks: Callable[[int, int], Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")  # srun --gpus-per-task=1
    fake = host(1)
    horovod_ranks(2, 4)
    assert fake.visible_gpus() == ["/physical_device:GPU:0"]
    assert list(fake.growth.values()) == [True]


def test_one_process_pins_the_first_gpu_with_memory_growth(
    host: Callable[[int], FakeHost], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    fake = host(4)
    made = collectives.create_collectives(bind_cpus=False)
    assert type(made) is collectives.Collectives
    assert fake.visible_gpus() == ["/physical_device:GPU:0"]
    assert {d.name: grows for d, grows in fake.growth.items()} == {"/physical_device:GPU:0": True}


def test_a_new_world_keeps_the_gpu_the_process_pinned_first(
    host: Callable[[int], FakeHost],
    horovod_ranks: Callable[[int, int], Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake = host(2)
    horovod_ranks(1, 2)
    fake.started = True  # the first world trained
    horovod_ranks(1, 2)  # the same local rank again: quietly
    assert capsys.readouterr().err == ""
    horovod_ranks(0, 2)  # another local rank: told once
    horovod_ranks(0, 1)
    assert fake.visible_gpus() == ["/physical_device:GPU:1"]
    told = capsys.readouterr().err.splitlines()
    assert told == [
        f"{socket.gethostname()}: local rank 0 keeps /physical_device:GPU:1, pinned as local "
        "rank 1: TensorFlow cannot change the visible GPUs once it has started"
    ]


def test_without_gpus_pinning_is_a_no_op(
    host: Callable[[int], FakeHost],
    horovod_ranks: Callable[[int, int], Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = host(0)
    horovod_ranks(3, 4)  # CPU ranks outnumber the (no) GPUs: nothing to check
    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    collectives.create_collectives(bind_cpus=False)
    assert fake.visible == [fake.cpu]
    assert fake.growth == {}
