"""What a step costs in memory: the bytes autograd saves for backward (:func:`saved_bytes`; by part of a
``LanguageModel``: :func:`saved_by_part`), and a process's peak resident growth around a call
(:func:`peak_rss_growth`, Linux). What ``benchmarks/speed/bench_delta_rule.py`` and ``train_memory.py`` measure."""

from __future__ import annotations

import torch


def saved_bytes(step) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``step()`` runs (each storage once)."""
    seen = {}

    def pack(x):
        seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()  # each storage once
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        step()
    return sum(seen.values())


def status_bytes(field: str) -> int:
    """A memory field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_rss_growth(fn) -> int:
    """Peak resident memory growth (bytes) of this process around ``fn()``: the kernel's high-water mark VmHWM,
    reset to the current RSS just before (``/proc/self/clear_refs``). ru_maxrss is not usable for this: Linux
    carries it across exec, so a child of a big parent starts with the parent's peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = status_bytes("VmRSS")
    fn()
    return status_bytes("VmHWM") - base


def part_of(name: str, module, modules: dict) -> str | None:
    """The label a module's saved tensors count under (a mixer's own modules apart from the ops it runs
    inline), or None for a module that only contains labelled ones."""
    if name == "embed" or name.endswith("norm"):
        return "embedding" if name == "embed" else "norms"
    if name.endswith(".mixer"):
        return f"mixer:{type(module).__name__}"
    parent, _, child = name.rpartition(".")
    if parent.endswith(".mixer"):
        return f"mixer:{type(modules[parent]).__name__}.{child}"
    if name.endswith(".mlp"):
        return "mlp"
    return None


def saved_by_part(model, step) -> dict:
    """MB of the distinct storages autograd keeps during ``step()``, by :func:`part_of` of the innermost labelled
    module running when each is saved ("loss and head" outside every one); parameters are not counted."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack, seen = ["loss and head"], {}
    handles = []

    def leave(module, args, output):  # returns None: the output stays the module's
        stack.pop()

    modules = dict(model.named_modules())
    for name, module in modules.items():
        label = part_of(name, module, modules)
        if label:
            handles.append(module.register_forward_pre_hook(lambda m, a, label=label: stack.append(label)))
            handles.append(module.register_forward_hook(leave))

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = (stack[-1], t.untyped_storage().nbytes())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()
    finally:
        for h in handles:
            h.remove()
    out = {}
    for label, nbytes in seen.values():
        out[label] = out.get(label, 0.0) + nbytes / 2**20
    return dict(sorted(out.items()))
