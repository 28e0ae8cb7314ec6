"""The `tandem` command line: main.py parses and dispatches (`python -m clients.cli`, the `tandem` script), with
the flags the client commands share (options.py), the one-shot commands (commands.py), `tandem chat`
(chat_session.py), `tandem admin` (admin_command.py), `tandem serve` (serve_command.py) and `tandem plans`
(plans_command.py)."""
