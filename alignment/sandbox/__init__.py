"""Running untrusted code (a task's tests against a response, the ``python`` tool): a process per
run under resource limits and an audit hook (:mod:`alignment.sandbox.runner`, set up in the child
by :mod:`alignment.sandbox.child`)."""
