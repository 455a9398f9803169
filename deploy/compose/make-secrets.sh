#!/bin/sh
# The files compose.yaml mounts as secrets, made once per deployment (run as root: the kvtier files
# go to the image's uid 10001, mode 0400, so that no other user of the host can read them):
#     sudo deploy/compose/make-secrets.sh deploy/compose/secrets
# Then `docker compose ... up` finds them in ./secrets (or set KVTIER_SECRETS to the directory).
# Never commit the directory. Existing files are kept: rerunning it rotates nothing.
set -eu
dir=${1:-$(dirname "$0")/secrets}
uid=${KVTIER_UID:-10001}
install -d -m 0700 "$dir"
cd "$dir"
umask 077
new() { [ ! -e "$1" ]; }

new cluster.secret && openssl rand -hex 32 > cluster.secret
new grafana-admin.password && openssl rand -hex 16 > grafana-admin.password

# etcd (profile "ha"): a CA, one certificate for the three members (server and peer), one for kvtier.
if new etcd-ca.pem; then
  openssl req -x509 -newkey rsa:2048 -nodes -keyout etcd-ca.key -out etcd-ca.pem -days 3650 \
    -subj "/CN=kvtier etcd CA" 2>/dev/null
fi
sign() {  # sign NAME SUBJECT EXTENSIONS
  openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA etcd-ca.pem -CAkey etcd-ca.key -CAcreateserial -out "$1.pem" \
    -days 825 -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
new etcd-server.pem && sign etcd-server "/CN=etcd" \
  "subjectAltName=DNS:etcd-1,DNS:etcd-2,DNS:etcd-3,DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth,clientAuth"
new etcd-client.pem && sign etcd-client "/CN=kvtier" "extendedKeyUsage=clientAuth"

# Readable by the service that mounts each one, by nobody else.
chmod 0400 ./*
chmod 0444 etcd-ca.pem
chown "$uid:$uid" cluster.secret etcd-client.pem etcd-client.key || echo "not root: give cluster.secret and etcd-client.* to uid $uid" >&2
chown 472:0 grafana-admin.password || echo "not root: give grafana-admin.password to uid 472" >&2  # the grafana image's user
