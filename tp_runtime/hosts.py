"""Addresses and listening sockets for a launch on one host or across hosts.

Every socket this runtime or torchrun opens for its own use binds to one chosen address, never to
every interface: on one host that is loopback; across hosts it is the address the rendezvous
itself travels on, which the other hosts can reach by construction. torch's TCPStore and gloo bind
every interface unless told otherwise, so the launcher hands the store a socket bound here and
names gloo's interface.
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import socket
import struct

from tp_runtime.config import ConfigError

_SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface


def resolve(host: str) -> str:
    """The IP address `host` names here (the first one getaddrinfo gives, IPv4 preferred)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot resolve the host name {host!r}: {exc.strerror}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def is_loopback(host: str) -> bool:
    return ipaddress.ip_address(resolve(host)).is_loopback


def is_literal_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def route_address(peer: str, port: int) -> str:
    """The local address this host uses to reach peer:port: the interface the rendezvous takes.

    A connected UDP socket makes the kernel pick the route and source address without sending
    anything, so it works before the peer is listening."""
    ip = resolve(peer)
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((ip, port))
        except OSError as exc:
            raise ConfigError(f"this host has no route to {peer} ({ip}): {exc.strerror}") from None
        return str(probe.getsockname()[0])


def interface_of(ip: str) -> str | None:
    """The name of the interface that holds the IPv4 address `ip` (for GLOO_SOCKET_IFNAME), or None."""
    if ":" in ip:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _index, name in socket.if_nameindex():
            request = array.array("B", struct.pack("256s", name.encode()[:15]))
            try:
                fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(request.tobytes()[20:24]) == ip:
                return name
    return None


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening, with SO_REUSEADDR as servers set it (a port
    whose last connection lingers in TIME_WAIT is free to bind again)."""
    ip = resolve(host)
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((ip, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def check_can_listen(host: str, port: int) -> None:
    """Binds host:port the way uvicorn will (asyncio's create_server: every address getaddrinfo
    gives, SO_REUSEADDR, IPv6 sockets v6-only), then lets go; raises OSError if uvicorn would fail.

    Binding without SO_REUSEADDR would refuse a port for a minute after a server stopped, while its
    closed connections sit in TIME_WAIT, though uvicorn itself could bind it."""
    infos = set(socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE))
    probes: list[socket.socket] = []
    try:
        for family, kind, proto, _name, address in infos:
            probe = socket.socket(family, kind, proto)
            probes.append(probe)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(address)
    finally:
        for probe in probes:
            probe.close()


def scheduler_address(advertise_host: str, master_addr: str) -> str:
    """The IP the scheduler binds and the other hosts connect to.

    MASTER_ADDR is the address torchrun published for rank 0's host, the one every other host's
    ranks already reached its store by: the interface the rendezvous uses. --advertise-host
    overrides it. A loopback address is taken only when MASTER_ADDR is itself loopback, that is when
    every host of the launch is this machine; a host name that resolves to loopback here (the
    127.0.1.1 of many /etc/hosts) is refused, since other hosts could not reach it.
    """
    host = advertise_host or master_addr
    ip = resolve(host)
    peers_on_this_machine = master_addr == "localhost" or (is_literal_ip(master_addr) and ipaddress.ip_address(master_addr).is_loopback)
    if ipaddress.ip_address(ip).is_loopback and not peers_on_this_machine:
        raise ConfigError(
            f"{host} is {ip} on this host, a loopback address the other hosts cannot reach: pass "
            "--advertise-host with an address of this host that they can"
        )
    return ip
