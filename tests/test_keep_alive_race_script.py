"""scripts/keep-alive-race.py sends requests after an idle gap."""

from __future__ import annotations

import pytest

from helpers import load_script


def _script():
    return load_script("keep-alive-race.py")


def test_the_gaps_spread_over_forty_milliseconds():
    gaps = _script().gaps_around(5.0, 41)
    assert len(gaps) == 41
    assert gaps[0] == pytest.approx(4.98) and gaps[-1] == pytest.approx(5.02)
    assert gaps[20] == pytest.approx(5.0)
    assert _script().gaps_around(5.0, 1) == [5.0]


def test_no_request_fails_where_the_client_drops_idle_connections_first(capsys):
    # The client keeps an idle connection 0.2 s, the server 0.5 s: the gaps
    # (0.28-0.32 s) outlast the client's, so each second request connects
    # anew, and none can meet a closing connection.
    failed = _script().main(
        ["--server", "0.5", "--client", "0.2", "--around", "0.3", "--requests", "3"]
    )
    assert failed == []
    assert "0 of 3 requests failed" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--server", "0"], "--server 0.0"), (["--requests", "0"], "--requests 0")],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        _script().main(argv)
    assert message in capsys.readouterr().err
