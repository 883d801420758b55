"""gloo's pair listeners, closed once their pair is connected.

Each pair group's gloo device listens on an ephemeral port of its process for the one
connection of its peer, and keeps listening for as long as the group lives.  Whatever connects
there is kept, one descriptor each, with no bound and no timeout, and at the open-files limit
gloo's listener raises in its loop thread and aborts the process (``accept: Too many open
files``: measured on rank 0 at a hard limit of 1,024 with 3,000 idle connections to one pair's
port).  torch 2.13 offers no way to hand gloo a listening socket or to close its listener, so
``seal`` does it from outside once the pair has connected (``transport.join``): it puts, under
the listener's descriptor number, a Unix listening socket that nobody can reach (its path is
removed at once) and registers it in gloo's epoll set with gloo's own handler, so gloo never
sees a connection again and its own teardown (``EPOLL_CTL_DEL``, ``close``) finds what it
expects.  What strangers connected before the seal stays gloo's until the group is freed.

Which listener is gloo's: ``before()`` is taken just before a pair group is made and
``made_since(before, address)`` just after; a listening socket counts as the group's only if it
appeared in between, is bound to the group's ``address`` and sits in an epoll set that also
appeared in between (each gloo device makes its own event loop).  A listening socket another
thread of the program opens meanwhile is left alone unless that thread also makes a new epoll
set, registers the socket there and binds it to the same address within the same milliseconds.

Linux only (``/proc``, ``epoll``); anywhere it cannot find what it expects it leaves the
listener as it is and logs why.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import re
import shutil
import socket
import tempfile

logger = logging.getLogger("rlcollect")

_EPOLL_CTL_ADD = 1


if platform.machine() in ("x86_64", "AMD64"):
    class _EpollEvent(ctypes.Structure):  # ``struct epoll_event`` is packed on x86-64 (sys/epoll.h)
        _pack_ = 1
        _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]
else:
    class _EpollEvent(ctypes.Structure):
        _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]


def _sockets() -> dict[int, int]:
    """``{fd: inode}`` of this process's sockets."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(name)] = int(target[8:-1])
    return out


def _epolls() -> set[int]:
    """This process's epoll descriptors."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[eventpoll]":
                out.add(int(name))
        except OSError:
            continue
    return out


def before() -> tuple[dict[int, int], set[int]]:
    """What listens and which epoll sets exist now (``made_since``'s reference)."""
    return listening(), _epolls()


def _addresses(host: str) -> set[str]:
    """The IP addresses ``host`` names (empty if it does not resolve)."""
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return set()


def made_since(reference: tuple[dict[int, int], set[int]], address: str) -> list[tuple[int, int]]:
    """``(fd, inode)`` of the listening sockets that appeared since ``reference`` (``before()``),
    bound to ``address`` and registered in an epoll set that also appeared since: the listener
    of the gloo device made in between."""
    listened, epolls = reference
    wanted = _addresses(address)
    found = []
    for fd, inode in listening().items():
        if listened.get(fd) == inode:
            continue
        try:
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            bound = probe.getsockname()[0]
        except OSError:
            continue
        finally:
            probe.close()
        if wanted and bound not in wanted:
            continue
        registered = _registration(fd, inode)
        if registered is not None and registered[0] not in epolls:
            found.append((fd, inode))
    if not found:
        logger.warning("rlcollect: gloo's pair listener on %s was not found; it stays open", address)
    return found


def listening() -> dict[int, int]:
    """``{fd: inode}`` of this process's listening TCP sockets."""
    out = {}
    for fd, inode in _sockets().items():
        try:
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if probe.family in (socket.AF_INET, socket.AF_INET6) and probe.type == socket.SOCK_STREAM and \
                    probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                out[fd] = inode
        except OSError:
            pass
        finally:
            probe.close()
    return out


def _registration(fd: int, inode: int) -> tuple[int, int, int] | None:
    """``(epoll fd, events, data)`` of the epoll set that watches socket ``fd`` (``inode``)."""
    line = re.compile(rf"^tfd:\s+{fd}\s+events:\s+([0-9a-f]+)\s+data:\s+([0-9a-f]+).*\sino:([0-9a-f]+)", re.M)
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") != "anon_inode:[eventpoll]":
                continue
            with open(f"/proc/self/fdinfo/{name}") as f:
                found = line.search(f.read())
        except OSError:
            continue
        if found and int(found.group(3), 16) == inode:
            return int(name), int(found.group(1), 16), int(found.group(2), 16)
    return None


def seal(fd: int, inode: int) -> bool:
    """Stop gloo's listener on descriptor ``fd`` (socket ``inode``) from taking connections;
    True if done."""
    if _sockets().get(fd) != inode:
        return False  # freed already (its group is gone): nothing of it listens
    registered = _registration(fd, inode)
    if registered is None:
        logger.warning("rlcollect: gloo's pair listener (fd %d) is not in an epoll set; it stays open", fd)
        return False
    epfd, events, data = registered
    libc = ctypes.CDLL(None, use_errno=True)  # this process's symbols: libc's among them (no ldconfig run)
    folder = tempfile.mkdtemp(prefix="rlcollect-sealed-")
    stand_in = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        stand_in.bind(os.path.join(folder, "s"))
        stand_in.listen(1)
        stand_in.setblocking(False)  # gloo's accept on it: EAGAIN, never a connection
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # no path left: nobody can connect
    try:
        if libc.dup2(stand_in.fileno(), fd) != fd:  # the listening socket is closed here (its last descriptor)
            logger.warning("rlcollect: could not close gloo's pair listener (fd %d): %s", fd,
                           os.strerror(ctypes.get_errno()))
            return False
        event = _EpollEvent(events, data)
        if libc.epoll_ctl(epfd, _EPOLL_CTL_ADD, fd, ctypes.byref(event)) != 0:
            # gloo's teardown would fail to unregister it and abort: say so loudly.
            logger.error("rlcollect: gloo's pair listener (fd %d) was closed but its stand-in could not be "
                         "registered (%s); freeing this pair group may abort the process", fd,
                         os.strerror(ctypes.get_errno()))
            return False
        return True
    finally:
        stand_in.close()
