"""What to change in your own PyTorch loop, per technique the recipe chose: short snippets.

Keyed by recipe key; each entry is a function of the chosen value (None: nothing to show,
e.g. the plain-PyTorch value). The snippets show the change, not speedbench's code: a user's
loop is `for x, y in loader: loss = loss_fn(model(x), y); loss.backward(); opt.step()`.

(Once every technique module carries its own method card, these may move there.)
No torch import: report layer.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

Snippet = tuple[str, str]  # (title, code)


def _precision(value: str) -> Optional[Snippet]:
    if value == "bf16":
        return ("bf16 autocast (no loss scaling needed)", """\
device_type = "cuda" if x.is_cuda else "cpu"
with torch.autocast(device_type, dtype=torch.bfloat16):
    loss = loss_fn(model(x), y)
loss.backward()
opt.step(); opt.zero_grad(set_to_none=True)""")
    if value == "fp16":
        return ("fp16 autocast with a GradScaler", """\
scaler = torch.amp.GradScaler("cuda")           # once, before the loop
with torch.autocast("cuda", dtype=torch.float16):
    loss = loss_fn(model(x), y)
scaler.scale(loss).backward()
scaler.step(opt); scaler.update(); opt.zero_grad(set_to_none=True)""")
    return None


def _workers(value: int) -> Optional[Snippet]:
    if not value:
        return None
    return (f"{value} DataLoader worker{'s' if value > 1 else ''}", f"""\
loader = torch.utils.data.DataLoader(
    dataset, batch_size=batch_size, shuffle=True,
    num_workers={value}, persistent_workers=True)  # workers survive the epoch's end""")


def _pin(value: bool) -> Optional[Snippet]:
    return ("pinned host memory", """\
loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, pin_memory=True)""") \
        if value else None


def _non_blocking(value: bool) -> Optional[Snippet]:
    return ("asynchronous host-to-device copies (with pinned memory)", """\
x = x.to(device, non_blocking=True)
y = y.to(device, non_blocking=True)""") if value else None


def _sync(value: str) -> Optional[Snippet]:
    if value != "deferred":
        return None
    return ("no host read every step: accumulate the loss on the device", """\
running = torch.zeros((), device=device)        # before the loop
...
running += loss.detach()                        # instead of loss.item()
if step % 10 == 0:
    print(running.item() / 10); running.zero_()  # one host read per 10 steps""")


def _tensor_creation(value: str) -> Optional[Snippet]:
    if value != "device":
        return None
    return ("create per-step tensors on the device", """\
noise = torch.randn(shape, device=x.device)     # not torch.randn(shape).to(device)
mask = torch.ones(n, n, device=x.device, dtype=torch.bool).tril()""")


def _empty_cache(value: bool) -> Optional[Snippet]:
    return None if value else ("never call torch.cuda.empty_cache() in the loop", """\
# delete: torch.cuda.empty_cache()   # it frees the allocator's cache, which the next step refills""")


def _accumulate(value: int) -> Optional[Snippet]:
    if not value or value <= 1:
        return None
    return (f"gradient accumulation over {value} micro-batches", f"""\
for i, (x, y) in enumerate(loader):
    loss = loss_fn(model(x), y) / {value}
    loss.backward()
    if (i + 1) % {value} == 0:
        opt.step(); opt.zero_grad(set_to_none=True)""")


def _parallel(value: str) -> Optional[Snippet]:
    if value == "ddp":
        return ("DistributedDataParallel (launch with torchrun --nproc_per_node=N train.py)", """\
torch.distributed.init_process_group("nccl")     # "gloo" on CPUs
model = torch.nn.parallel.DistributedDataParallel(model.to(device))
sampler = torch.utils.data.DistributedSampler(dataset)
loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler)""")
    if value == "fsdp":
        return ("FSDP2: shard parameters, gradients and optimizer state over ranks", """\
from torch.distributed.fsdp import fully_shard
for block in model.blocks:
    fully_shard(block)
fully_shard(model)""")
    return None


def _compile(value: Any) -> Optional[Snippet]:
    if value in (None, False, "off", "none", "eager"):
        return None
    mode = "" if value in (True, "default", "on") else f', mode="{value}"'
    return ("torch.compile", f"""\
model = torch.compile(model{mode})   # the first steps compile; time them out""")


def _memory_format(value: str) -> Optional[Snippet]:
    if value != "channels_last":
        return None
    return ("channels_last memory format (convolutional models)", """\
model = model.to(memory_format=torch.channels_last)
x = x.to(device, memory_format=torch.channels_last)""")


def _matmul_precision(value: str) -> Optional[Snippet]:
    if value in (None, "highest"):
        return None
    return (f"float32 matmul precision '{value}' (TF32 on Ampere+ GPUs)", f"""\
torch.set_float32_matmul_precision("{value}")""")


def _cudnn_benchmark(value: bool) -> Optional[Snippet]:
    return ("cuDNN autotuning for fixed input shapes", """\
torch.backends.cudnn.benchmark = True""") if value else None


def _optimizer_impl(value: str) -> Optional[Snippet]:
    if value not in ("foreach", "fused"):
        return None
    return (f"{value} optimizer kernels", f"""\
opt = torch.optim.AdamW(model.parameters(), lr=lr, {value}=True)""")


def _checkpointing(value: Any) -> Optional[Snippet]:
    if value in (None, False, "off", "none"):  # speedbench's values: off | blocks
        return None
    return ("activation checkpointing per block (less memory, more compute)", """\
from torch.utils.checkpoint import checkpoint
def forward(self, x):
    for block in self.blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return self.head(x)""")


def _attention(value: str) -> Optional[Snippet]:
    if value in (None, "default", "auto"):
        return None
    backend = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
               "cudnn": "CUDNN_ATTENTION", "math": "MATH"}.get(value, str(value).upper())
    return (f"SDPA {value} attention backend", f"""\
from torch.nn.attention import SDPBackend, sdpa_kernel
with sdpa_kernel(SDPBackend.{backend}):
    loss = loss_fn(model(x), y)""")


SNIPPETS: dict[str, Callable[[Any], Optional[Snippet]]] = {
    "precision": _precision,
    "data.num_workers": _workers,
    "data.pin_memory": _pin,
    "data.non_blocking": _non_blocking,
    "sync": _sync,
    "tensor_creation": _tensor_creation,
    "empty_cache": _empty_cache,
    "accumulate": _accumulate,
    "parallel": _parallel,
    "compile": _compile,
    "memory_format": _memory_format,
    "matmul_precision": _matmul_precision,
    "cudnn_benchmark": _cudnn_benchmark,
    "optimizer.impl": _optimizer_impl,
    "checkpointing": _checkpointing,
    "attention": _attention,
}


def for_overrides(overrides: Mapping[str, Any]) -> list[Snippet]:
    """The snippets of a chosen option's overrides, keys without a snippet left out."""
    out = []
    for key, value in overrides.items():
        make = SNIPPETS.get(key)
        snippet = make(value) if make else None
        if snippet:
            out.append(snippet)
    return out
