"""Hostile peers: secrets never echoed, refused logins and protocol errors logged, SIGTERM closes clients.

* `--user` with a malformed value never shows the value (it may hold a password);
* a refused login and every connection.close the broker sends for an error are logged at WARNING, naming
  the peer and the user, never the password (RabbitMQ logs "... refused for user 'x' ..." likewise);
* SIGTERM: `python -m spark_amqp_broker` closes every open connection with connection.close 320
  CONNECTION_FORCED (RabbitMQ's text: "broker forced connection closure with reason 'shutdown'") and
  exits 0.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


# ----------------------------------------------------------------------------- --user is not echoed


@pytest.mark.parametrize("value", ["bob=SeCrEt-42", "SeCrEt-42", ":SeCrEt-42"],
                         ids=["equals-sign", "no-separator", "empty-name"])
def test_malformed_user_value_is_not_echoed(tmp_path, value):
    proc = subprocess.run([sys.executable, "-m", "spark_amqp_broker", "--port", "0", "--user", value],
                          cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith("error: --user expects NAME:PASSWORD"), proc.stderr
    assert "SeCrEt" not in proc.stderr and "SeCrEt" not in proc.stdout
    assert "bob" not in proc.stderr
