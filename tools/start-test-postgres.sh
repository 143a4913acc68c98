#!/usr/bin/env bash
# Start (once) the PostgreSQL that tests/test_front_postgres.py runs two fronts on, and print its URL.
#
#   export H3KIT_TEST_POSTGRES_URL=$(tools/start-test-postgres.sh)
#
# Debian's postgresql package: installed when missing (the package list refreshed only when the install fails
# without it), its first cluster started when down, and a role h3kit_test (login, createdb) made once; each
# test makes and drops a database of its own. Cheap when all is there already. Needs root or sudo -n.
set -euo pipefail
# stdout carries the URL alone: whatever the tools print (pg_ctlcluster's "Removed stale pid file." on a machine
# that was not shut down cleanly broke CI's URL on 2026-12-06) goes to stderr. No extra descriptor holds the
# caller's pipe: the server pg_ctlcluster starts would keep it open and `$(...)` would never return.
{
sudo=; [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
say() { printf 'start-test-postgres: %s\n' "$*" >&2; }
if ! command -v pg_lsclusters >/dev/null || [ -z "$(pg_lsclusters -h 2>/dev/null)" ]; then
  apt_install() { DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends postgresql >/dev/null; }
  apt_install || { $sudo apt-get update >/dev/null && apt_install; }
fi
read -r ver name port status _ < <(pg_lsclusters -h | head -n 1)
if [ "$status" != "online" ]; then
  say "starting cluster $ver/$name on port $port"
  $sudo pg_ctlcluster "$ver" "$name" start
fi
psql_admin() { $sudo runuser -u postgres -- psql -p "$port" -qtAX -v ON_ERROR_STOP=1 "$@"; }
for _ in $(seq 50); do psql_admin -c 'select 1' >/dev/null 2>&1 && break; sleep 0.2; done
if [ "$(psql_admin -c "select 1 from pg_roles where rolname = 'h3kit_test'")" != "1" ]; then
  psql_admin -c "create role h3kit_test login createdb password 'h3kit_test'" >/dev/null
fi
} >&2
echo "postgresql://h3kit_test:h3kit_test@127.0.0.1:$port/postgres"
