"""The helper of a two-server study: the second server, in its own trust domain, that opens the
helper's share of each record, refuses records on its own and folds its shares into per-round
sums in its own Redis (docs/architecture.md, "The helper")."""
