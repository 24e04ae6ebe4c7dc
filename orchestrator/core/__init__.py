"""The pure core: the event catalogue, the state, `evolve` (the reducer) and `decide` (the rules)."""
