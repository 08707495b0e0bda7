"""Which addresses listen on this host, read from the kernel (``/proc/net/tcp``, ``tcp6``, ``/proc/PID/fd``)."""

import ipaddress
import os


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        inodes.update(link[len("socket:["):-1] for link in links if link.startswith("socket:["))
    return inodes


def listening_addresses(port: int | None = None, pids: list[int] | None = None) -> list:
    """Every local address in LISTEN state on ``port`` and/or owned by ``pids`` (IPv4-mapped IPv6 as IPv4)."""
    inodes = _socket_inodes(pids) if pids is not None else None
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            address, port_hex = fields[1].split(":")
            if fields[3] != "0A" or (port is not None and int(port_hex, 16) != port):  # 0A: LISTEN
                continue
            if inodes is not None and fields[9] not in inodes:
                continue
            raw = bytes.fromhex(address)  # the kernel prints each 32-bit word in host (little-endian) order
            ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
            found.append((ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else ip)
    return found
