"""The guest's users and groups: ``/etc/passwd`` and ``/etc/group``, read once before the
snapshot.

The image has root, ``user`` (uid and gid 1000, home ``/home/user``: E2B's user, whom
E2B's commands and files belong to by default) and nobody. Processes the host starts as a
user (``bud_procs``) take its ids, groups, home and shell from here, and file listings
(``bud_session``) name owners and groups with it.

The tables are read at import, before the template's snapshot, so a lookup costs no system
call. A name or number that is not in them makes them be read again (at most once per
lookup: a user a job added to ``/etc/passwd`` is found); an id no entry names is reported
as its number, as ``ls -l`` does.
"""

import collections

PASSWD = "/etc/passwd"
GROUP = "/etc/group"

User = collections.namedtuple("User", "name uid gid home shell groups")


def _read(path):
    """The lines of ``path`` split at ``:`` (none if it cannot be read)."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return [line.rstrip("\n").split(":") for line in f if not line.startswith("#")]
    except OSError:
        return []


class Table:
    """Users by name, and the names of user and group ids."""

    def __init__(self):
        self.users = {}
        self.user_names = {}
        self.group_names = {}
        self.load()

    def load(self):
        users, user_names, group_names, members = {}, {}, {}, collections.defaultdict(list)
        for fields in _read(GROUP):
            if len(fields) >= 4 and fields[2].isdigit():
                gid = int(fields[2])
                group_names.setdefault(gid, fields[0])
                for m in filter(None, fields[3].split(",")):
                    members[m].append(gid)
        for fields in _read(PASSWD):
            if len(fields) >= 7 and fields[2].isdigit() and fields[3].isdigit():
                name, uid, gid = fields[0], int(fields[2]), int(fields[3])
                groups = [gid] + [g for g in members.get(name, ()) if g != gid]
                users.setdefault(name, User(name, uid, gid, fields[5] or "/",
                                            fields[6] or "/bin/sh", groups))
                user_names.setdefault(uid, name)
        self.users, self.user_names, self.group_names = users, user_names, group_names

    def user(self, name):
        """User ``name`` of ``/etc/passwd``, or None."""
        if name not in self.users:
            self.load()
        return self.users.get(name)

    def names(self, uids, gids):
        """``(user names, group names)`` of the ids: dicts from each id to its name (its
        number as text if no entry names it), reading the files again at most once."""
        if any(u not in self.user_names for u in uids) or any(
                g not in self.group_names for g in gids):
            self.load()
        return ({u: self.user_names.get(u, str(u)) for u in uids},
                {g: self.group_names.get(g, str(g)) for g in gids})


TABLE = Table()
