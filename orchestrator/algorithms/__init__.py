"""The algorithms, one module each, chosen by `algorithm.name` from `orchestrator.config.ALGORITHMS`.

An algorithm's module declares all of it: its settings (the `algorithm.<name>` section, an
`AlgorithmComponent`), whether it finalizes in the background (the section's
`finalize_in_background`), what its section puts in the core's params (`core_settings`) and its
group finalizer (`build`). The rest of orch calls it through that interface alone.

An algorithm the core scores inline also names its scorer in `orchestrator.core.advantages`:
the core re-scores a log from its `run_started` alone, so the arithmetic it runs lives there,
and the finalizer calls the same function (inline and background agree). Background-finalized
algorithms run `finalize_group` concurrently for many groups, and results come back in any
order: a stateful algorithm must tolerate interleaved groups (docs/rules.md, 3. Finalize).
"""
