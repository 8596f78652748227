"""A hostile 'daemon' for the weight-cache threat tests: answers every request with a canned reply.

Run as another user (``subprocess.Popen(..., user=65534)``) (``--user 65534``) it plays the neighbour who got to a
predictable socket path first. Standard library only: it must not need JAX or this package.

usage: fake_weight_cache_daemon.py REPLY_JSON (--path SOCKET | --fd LISTENING_FD) [--segment NAME SIZE]
                                   [--user UID]
  --path: bind SOCKET (0666) in a directory of its own; --fd: listen on an inherited bound socket,
  so SO_PEERCRED reports *this* process's uid; --segment: first create shared memory NAME (0666).
"""

import argparse
import os
import socket
import struct


def main():
    p = argparse.ArgumentParser()
    p.add_argument("reply")
    p.add_argument("--path")
    p.add_argument("--fd", type=int)
    p.add_argument("--segment", nargs=2, metavar=("NAME", "SIZE"))
    p.add_argument("--user", type=int, help="become this uid (and gid) first: the other user")
    args = p.parse_args()
    if args.user is not None:
        os.setgid(args.user)
        os.setuid(args.user)
    with open(args.reply, "rb") as f:
        reply = f.read()
    if args.segment:
        name, size = args.segment[0], int(args.segment[1])
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        os.fchmod(fd, 0o666)
        os.write(fd, b"\x7f" * size)  # every byte a NaN in float8_e4m3fn: "poisoned weights"
        os.close(fd)
    if args.fd is not None:
        listener = socket.socket(fileno=args.fd)
    else:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(args.path)
        os.chmod(args.path, 0o666)
    listener.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            try:
                conn.recv(1 << 20)
                conn.sendall(struct.pack(">I", len(reply)) + reply)
            except OSError:
                pass


if __name__ == "__main__":
    main()
