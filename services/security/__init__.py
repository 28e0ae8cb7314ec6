"""Transport security shared by both services (torch-free, no engine or frontend imports).

tls.py loads certificates into gRPC credentials, auth.py checks bearer tokens,
transport.py builds servers and channels from them, flags.py is the command line.
"""
