"""NeMo Gym agents as an orch env (docs/nemo_gym.md): :mod:`.component` (the section),
:mod:`.config` (settings, rows, the servers' config), :mod:`.route` (orch's Responses route),
:mod:`.servers` (the servers orch starts), :mod:`.env` (an episode)."""
