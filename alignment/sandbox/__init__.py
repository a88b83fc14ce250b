"""Running untrusted code (a task's tests against a response, the ``python`` tool): a process per
run in a bubblewrap container (:mod:`alignment.sandbox.bwrap`) under resource limits and an audit
hook (:mod:`alignment.sandbox.runner`, set up inside by :mod:`alignment.sandbox.child`)."""
