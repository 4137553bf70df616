"""This host's listening TCP sockets and addresses, read from /proc."""

from __future__ import annotations


def listening_sockets(inodes: set[str] | None = None) -> dict[int, set[str]]:
    """port -> the addresses listened on at it, of every listening TCP socket of this host
    (of those with one of ``inodes`` only, when given)."""
    import ipaddress
    from pathlib import Path

    found: dict[int, set[str]] = {}
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or (inodes is not None and inode not in inodes):  # 0A: LISTEN
                continue
            address, port = local.split(":")
            raw = bytes.fromhex(address)
            # The kernel writes each 32-bit word in host order (little-endian here).
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.setdefault(int(port, 16), set()).add(str(ipaddress.ip_address(raw)))
    return found


def non_loopback_address() -> str | None:
    """An IPv4 address of this host that is not loopback (eth0's), or None."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: the route picks the address
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address
