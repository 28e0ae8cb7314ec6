"""Every server listens on loopback unless told otherwise: plaintext without a token is for this machine."""

from __future__ import annotations

from clients.cli.main import build_parser as cli_parser
from services.engine.__main__ import build_parser as engine_parser
from services.frontend.__main__ import parse_args as frontend_parse_args

LOOPBACK = "127.0.0.1"


def test_tandem_engine_tandem_frontend_and_tandem_serve_default_to_loopback():
    assert engine_parser().parse_args([]).host == LOOPBACK
    assert frontend_parse_args([]).host == LOOPBACK
    assert cli_parser().parse_args(["serve"]).host == LOOPBACK


def test_frontend_help_says_how_to_listen_on_every_interface(capsys):
    try:
        frontend_parse_args(["--help"])
    except SystemExit:
        pass
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"default: {LOOPBACK}" in help_text and "0.0.0.0 for all interfaces" in help_text
