"""The processes under the strategy: ports, launch, rank-zero errors, the multirun patch, a clean exit, and the
forensics that turn another rank's failure into an error that names it (`lightning_hybrid.runtime.forensics`).
Nothing here knows a parallel dimension."""
