"""Lightning's ``DeepSpeedStrategy`` on the CPU (gloo), for the tests and
``benchmarks.ddp_overhead``: Lightning runs DeepSpeed only on CUDA.

Lightning refuses any accelerator but CUDA (``setup_environment``), checks CUDA device
indices (``setup_distributed``) and hands DeepSpeed the device's index, None on the CPU,
which DeepSpeed cannot compare. The subclass skips the first two and hands DeepSpeed no
index, so that DeepSpeed takes the local rank; everything else is Lightning's and
DeepSpeed's own (its CPU accelerator, ZeRO, the engine's step). DeepSpeed's shared-memory
all-reduce for CPUs, a C++ extension it would compile when it starts, is left out: gloo
carries every collective.

DeepSpeed's CPU accelerator allows fp16 only where oneDNN has float16 kernels (it asks
``torch.ops.mkldnn._is_mkldnn_fp16_supported``, true on some Intel CPUs), while torch
computes float16 on any CPU. The seam allows it everywhere, so that DeepSpeed's fp16
path, its dynamic loss scaler with its overflow skips, runs here whatever the CPU.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any


def cpu_deepspeed_strategy(stage: int, timeout: timedelta, **kwargs: Any) -> Any:
    """Lightning's ``DeepSpeedStrategy`` at ZeRO ``stage`` (``kwargs``: its other
    arguments), runnable on the CPU (see the module's docstring)."""
    import deepspeed
    import deepspeed.comm.torch
    from deepspeed.accelerator import get_accelerator
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    deepspeed.comm.torch.build_shm_op = lambda: None
    get_accelerator().is_fp16_supported = lambda: True  # whatever this CPU's oneDNN has

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)  # the CUDA check skipped

        def setup_distributed(self) -> None:
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
            engine, optimizer, _, _ = deepspeed.initialize(
                args=None,
                config=self.config,
                model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad],
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                dist_init_required=False,
            )
            return engine, optimizer

    return CPUDeepSpeedStrategy(
        stage=stage, process_group_backend="gloo", timeout=timeout, **kwargs
    )
