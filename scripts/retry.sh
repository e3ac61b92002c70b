# Sourced by the set-up scripts. `retry CMD...` runs a command that downloads (pip, apt-get) up to
# PRISM_SETUP_TRIES times (4), waiting 15 s, 30 s, 45 s between tries: a package index that drops the
# connection mid-download (pip's own resume can stall at the same byte on every attempt) then costs a
# minute, not the whole run. A retried pip install starts over and keeps what it already installed.
retry() {
  local try=1 tries=${PRISM_SETUP_TRIES:-4}
  until "$@"; do
    if [ "$try" -ge "$tries" ]; then
      echo "prism: failed $tries times: $*" >&2
      return 1
    fi
    echo "prism: failed (try $try of $tries), again in $((15 * try)) s: $*" >&2
    sleep $((15 * try))
    try=$((try + 1))
  done
}
