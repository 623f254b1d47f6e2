"""A CPU platform for verl 0.9.1, which ships cuda / npu / rocm platforms only: on a machine
without a GPU it falls back to nvidia and then calls torch.cuda (memory statistics, the loss
all-reduce device) and asks for nccl. use_cpu_platform() installs this one through verl's plugin
API (verl.plugin.platform.set_platform): device "cpu", backend gloo, zero memory statistics.

Importing critic_adapters.integrations.verl calls install_if_no_accelerator() (before verl's
modules ask for the device name: the first ask fixes verl's platform): on a machine with no CUDA or
NPU device and no VERL_PLATFORM set, verl then runs on CPU. Nothing changes on GPUs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import types

import torch


def _zero(*args, **kwargs):
    return 0


def _nothing(*args, **kwargs):
    return None


# What verl calls on `get_torch_device()` (its platform's device module) on these code paths.
CPU_DEVICE_MODULE = types.SimpleNamespace(
    is_available=lambda: True, current_device=lambda: "cpu", device_count=lambda: 1, set_device=_nothing,
    synchronize=_nothing, empty_cache=_nothing, manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
    get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state, memory_allocated=_zero,
    memory_reserved=_zero, max_memory_allocated=_zero, max_memory_reserved=_zero, reset_peak_memory_stats=_nothing,
    mem_get_info=lambda *args, **kwargs: (0, 0), set_per_process_memory_fraction=_nothing,
    get_device_name=lambda *args, **kwargs: "CPU",
)


def cpu_platform():
    """An instance of verl's PlatformBase for CPU (built on call: verl is imported only then)."""
    from verl.plugin.platform import PlatformBase

    class CPUPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = CPU_DEVICE_MODULE

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"  # verl moves micro-batches with .to(get_device_id())

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    return CPUPlatform()


def use_cpu_platform() -> None:
    """Make verl run on CPU in this process (see the module docstring)."""
    from verl.plugin.platform import set_platform

    from .plugin import after_import

    set_platform(cpu_platform())
    after_import("verl.utils.distributed", _gloo_process_groups)


def _gloo_process_groups(module) -> None:
    """verl.utils.distributed joins the process group with the backend `cpu:gloo,<device>:<backend>`:
    on the CPU platform that is `cpu:gloo,cpu:gloo`, which torch refuses ("Duplicate device type
    cpu"). Its two functions get plain `gloo` instead (an explicit backend is kept)."""
    ray_variant = module.initialize_global_process_group_ray

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return ray_variant(timeout_second=timeout_second, backend=backend or "gloo")

    def initialize_global_process_group(timeout_second=36000):
        import datetime

        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_second),
                                                 init_method=os.environ.get("DIST_INIT_METHOD", None))
        return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # as verl's

    module.initialize_global_process_group_ray = initialize_global_process_group_ray
    module.initialize_global_process_group = initialize_global_process_group


def install_if_no_accelerator() -> bool:
    """use_cpu_platform() when this machine has neither CUDA nor NPU devices, VERL_PLATFORM is not
    set and verl has not chosen a platform yet; True when it did."""
    if torch.cuda.is_available() or os.environ.get("VERL_PLATFORM") or importlib.util.find_spec("torch_npu"):
        return False
    from verl.plugin.platform import platform_manager

    if platform_manager._current_platform is not None:  # chosen already: leave verl's choice alone
        return False
    use_cpu_platform()
    return True
