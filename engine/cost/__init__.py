"""Cost model and audit: the step's jaxpr ledger (`ledger`), hardware profiles
(`hardware`), pricing and the step prediction (`price`), compiled-HLO collective audit
(`hlo`, `audit`) and profiler-trace attribution (`trace`)."""
