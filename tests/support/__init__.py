"""Helpers the test modules share (they import from here, never from one another): the CLI in a
subprocess (`cli`), fake-run arguments (`runs`), core parameter builders and a hand driver of the
core (`params`), a run's log read back and its invariants checked (`logs`), and the parts a run
is built of (`parts`)."""
