"""The `splitproof train` configuration: verl's config tree typed (``schema``), merged like verl's Hydra
layers (``load``), checked naming dotted keys (``check``), verl keys that splitproof does not read told
apart from typos (``verl_keys``), and the key tables of docs/train.md generated from it all (``docs``).

Nothing is imported here, so that reading a config never loads torch or transformers."""
