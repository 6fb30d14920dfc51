{{/* Names, labels and the addresses the roles use to find each other. */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped base name; objects append -router, -prefill, ... (kept under 63). */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every pod of this release carries: the NetworkPolicy admits peers by these. */}}
{{- define "pdserve.releaseSelector" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Call with (dict "ctx" $ "component" "router"). */}}
{{- define "pdserve.selectorLabels" -}}
{{ include "pdserve.releaseSelector" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" .ctx }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Workers register at the router through a headless Service that also lists router pods that
are not ready yet, so registration never waits on the router's own readiness.
*/}}
{{- define "pdserve.routerRegistrationAddress" -}}
{{- printf "%s-router-headless:%d" (include "pdserve.fullname" .) (int .Values.router.registryPort) }}
{{- end }}

{{/* The Secret holding the metrics token: the user's, or the one the chart makes. */}}
{{- define "pdserve.metricsTokenName" -}}
{{- .Values.metrics.tokenSecret.name | default (printf "%s-metrics-token" (include "pdserve.fullname" .)) }}
{{- end }}

{{/* The Secret that holds the cluster secret (made by the chart unless existingSecret). */}}
{{- define "pdserve.clusterSecretName" -}}
{{- .Values.clusterSecret.existingSecret | default (printf "%s-cluster-secret" (include "pdserve.fullname" .)) }}
{{- end }}

{{/* Where every pod reads the cluster secret. */}}
{{- define "pdserve.clusterSecretDir" -}}/etc/pdserve/cluster{{- end }}

{{- define "pdserve.clusterSecretArg" -}}
{{- printf "--cluster-secret-file=%s/%s" (include "pdserve.clusterSecretDir" .) .Values.clusterSecret.key | quote }}
{{- end }}

{{- define "pdserve.clusterSecretMount" -}}
- name: cluster-secret
  mountPath: {{ include "pdserve.clusterSecretDir" . }}
  readOnly: true
{{- include "pdserve.internalTlsMount" . }}
{{- end }}

{{- define "pdserve.internalTlsMount" -}}
{{- if include "pdserve.internalTlsSecretName" . }}
- name: internal-tls
  mountPath: /etc/pdserve/internal-tls
  readOnly: true
{{- end }}
{{- end }}

{{/* The router's key ring (the call and block-hash keys, not the secret): an init container
with the secret derives it into a memory volume, the router's container mounts only that. */}}
{{- define "pdserve.routerKeysFile" -}}/etc/pdserve/router-keys/router-keys{{- end }}

{{/* The Secret of internal mutual TLS (ca.crt, tls.crt, tls.key: cert-manager's shape): the
user's, or the one the chart makes; empty when internalTLS.enabled is false. */}}
{{- define "pdserve.internalTlsSecretName" -}}
{{- if .Values.internalTLS.enabled }}
{{- .Values.internalTLS.secretName | default (printf "%s-internal-tls" (include "pdserve.fullname" .)) }}
{{- end }}
{{- end }}

{{/* The DNS names of the certificate the chart makes (a YAML list): the name every client
checks (rpc.credentials.INTERNAL_SERVER_NAME) and each Service's names in this namespace. */}}
{{- define "pdserve.internalTlsNames" -}}
{{- $fullname := include "pdserve.fullname" . }}
- "pdserve-internal"
{{- range $service := list "router" "router-headless" "prefill" "decode" }}
{{- $short := printf "%s-%s" $fullname $service }}
- {{ $short | quote }}
- {{ printf "%s.%s" $short $.Release.Namespace | quote }}
- {{ printf "%s.%s.svc" $short $.Release.Namespace | quote }}
- {{ printf "*.%s.%s.svc" $short $.Release.Namespace | quote }}
{{- end }}
{{- end }}

{{/* Mutual TLS on internal gRPC: where every role reads the Secret's files. */}}
{{- define "pdserve.internalTlsArgs" -}}
{{- if include "pdserve.internalTlsSecretName" . }}
- "--internal-tls-cert=/etc/pdserve/internal-tls/tls.crt"
- "--internal-tls-key=/etc/pdserve/internal-tls/tls.key"
- "--internal-tls-ca=/etc/pdserve/internal-tls/ca.crt"
{{- end }}
{{- end }}

{{- define "pdserve.clusterSecretVolume" -}}
- name: cluster-secret
  secret:
    secretName: {{ include "pdserve.clusterSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.clusterSecret.key }}
        path: {{ .Values.clusterSecret.key }}
{{- with include "pdserve.internalTlsSecretName" . }}
- name: internal-tls
  secret:
    secretName: {{ . }}
    defaultMode: 0440
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
{{- end }}

{{/* The Secret holding the internal Redis's password. */}}
{{- define "pdserve.redisAuthSecretName" -}}
{{- .Values.redis.internal.auth.existingSecret.name | default (printf "%s-redis-auth" (include "pdserve.fullname" .)) }}
{{- end }}

{{/*
A worker's Redis location. The password is a file (--redis-password-file, the internal
Redis's Secret) or, for an external Redis whose URL is a Secret, the whole URL is one
(--redis-url-file): no key on a command line or in the environment. PDSERVE_REDIS_URL
carries only a URL without a password.
*/}}
{{- define "pdserve.redisEnv" -}}
{{- $redis := .Values.redis }}
{{- if eq $redis.mode "internal" }}
- name: PDSERVE_REDIS_URL
  value: {{ printf "redis://%s-redis:%d/0" (include "pdserve.fullname" .) (int $redis.internal.port) | quote }}
{{- else if and (eq $redis.mode "external") (not $redis.external.existingSecret.name) }}
- name: PDSERVE_REDIS_URL
  value: {{ $redis.external.url | quote }}
{{- end }}
{{- end }}

{{- define "pdserve.redisArgs" -}}
{{- $redis := .Values.redis }}
{{- if eq $redis.mode "internal" }}
- "--redis-password-file=/etc/pdserve/redis/password"
{{- else if and (eq $redis.mode "external") $redis.external.existingSecret.name }}
- "--redis-url-file=/etc/pdserve/redis/url"
{{- end }}
{{- end }}

{{- define "pdserve.redisKeyMount" -}}
{{- if include "pdserve.redisArgs" . }}
- name: redis-key
  mountPath: /etc/pdserve/redis
  readOnly: true
{{- end }}
{{- end }}

{{- define "pdserve.redisKeyVolume" -}}
{{- $redis := .Values.redis }}
{{- if eq $redis.mode "internal" }}
- name: redis-key
  secret:
    secretName: {{ include "pdserve.redisAuthSecretName" . }}
    defaultMode: 0440
    items:
      - {key: {{ $redis.internal.auth.existingSecret.key }}, path: password}
{{- else if and (eq $redis.mode "external") $redis.external.existingSecret.name }}
- name: redis-key
  secret:
    secretName: {{ $redis.external.existingSecret.name }}
    defaultMode: 0440
    items:
      - {key: {{ $redis.external.existingSecret.key }}, path: url}
{{- end }}
{{- end }}

{{/* The metrics token, a file in every pdserve pod: /metrics (the workers' metrics port,
the router's HTTP /metrics) answers only `Authorization: Bearer <it>`. */}}
{{- define "pdserve.metricsTokenArg" -}}
"--metrics-token-file=/etc/pdserve/metrics-token/token"
{{- end }}

{{- define "pdserve.metricsTokenMount" -}}
- name: metrics-token
  mountPath: /etc/pdserve/metrics-token
  readOnly: true
{{- end }}

{{- define "pdserve.metricsTokenVolume" -}}
- name: metrics-token
  secret:
    secretName: {{ include "pdserve.metricsTokenName" . }}
    defaultMode: 0440
    items:
      - {key: {{ .Values.metrics.tokenSecret.key }}, path: token}
{{- end }}

{{/* Settings the schema cannot express; a broken combination fails the render. */}}
{{- define "pdserve.validate" -}}
{{- $kv := .Values.kvTransfer }}
{{- if and (has "redis" $kv.backends) (eq .Values.redis.mode "none") }}
{{- fail "kvTransfer.backends names redis but redis.mode is none: set redis.mode or drop the backend" }}
{{- end }}
{{- if and (has "disk" $kv.backends) (not $kv.diskStore.enabled) }}
{{- fail "kvTransfer.backends names disk but kvTransfer.diskStore.enabled is false" }}
{{- end }}
{{- $range := splitList "-" $kv.ucx.tcpPortRange }}
{{- if gt (int (index $range 0)) (int (index $range 1)) }}
{{- fail "kvTransfer.ucx.tcpPortRange: the first port must not exceed the last" }}
{{- end }}
{{- range $role := list "prefill" "decode" }}
{{- $ports := list (int (index $.Values $role).grpcPort) (int $kv.port) (int $.Values.metrics.port) }}
{{- if ne (len (uniq $ports)) 3 }}
{{- fail (printf "%s: grpcPort, kvTransfer.port and metrics.port must differ" $role) }}
{{- end }}
{{- range $port := $ports }}
{{- if and (ge $port (int (index $range 0))) (le $port (int (index $range 1))) }}
{{- fail (printf "%s: port %d lies inside kvTransfer.ucx.tcpPortRange" $role $port) }}
{{- end }}
{{- end }}
{{- end }}
{{- if eq (int .Values.router.httpPort) (int .Values.router.grpcPort) }}
{{- fail "router.httpPort and router.grpcPort must differ" }}
{{- end }}
{{- if .Values.planner.enabled }}
{{- range $role := list "prefill" "decode" }}
{{- if (index $.Values $role).autoscaling.enabled }}
{{- fail (printf "planner.enabled and %s.autoscaling.enabled: both would scale the %s Deployment; turn one off" $role $role) }}
{{- end }}
{{- $p := index $.Values.planner $role }}
{{- if or (lt (int $p.max) (int $p.min)) (lt (int $p.max) 1) }}
{{- fail (printf "planner.%s: max must be at least min and at least 1" $role) }}
{{- end }}
{{- end }}
{{- if eq (int .Values.planner.metricsPort) 0 }}
{{- fail "planner.metricsPort must be a port: the planner's liveness probe checks it" }}
{{- end }}
{{- end }}
{{- range $role := list "router" "prefill" "decode" }}
{{- $a := (index $.Values $role).autoscaling }}
{{- if and $a.enabled (lt (int $a.maxReplicas) (int $a.minReplicas)) }}
{{- fail (printf "%s.autoscaling: maxReplicas is below minReplicas" $role) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Enrollment (enrollment.yaml): the Secret of the enrollment key (private.pem: the
enroller's; public.pem: the routers'), the user's or the one the chart makes. */}}
{{- define "pdserve.enrollmentKeySecretName" -}}
{{- .Values.enrollment.keySecret | default (printf "%s-enrollment-key" (include "pdserve.fullname" .)) }}
{{- end }}

{{/* The ServiceAccount a worker role's pods run as: its own with enrollment on (the enroller
maps it to the role), else the release's. Call with (dict "ctx" $ "role" "prefill"|"decode"). */}}
{{- define "pdserve.workerServiceAccountName" -}}
{{- if .ctx.Values.enrollment.enabled }}
{{- printf "%s-%s" (include "pdserve.fullname" .ctx) .role }}
{{- else }}
{{- include "pdserve.serviceAccountName" .ctx }}
{{- end }}
{{- end }}

{{/* The enroller's URL: HTTPS under the internal certificate when internal TLS is on. */}}
{{- define "pdserve.enrollerUrl" -}}
{{- $scheme := ternary "https" "http" (not (empty (include "pdserve.internalTlsSecretName" .))) }}
{{- printf "%s://%s-enroller:%d" $scheme (include "pdserve.fullname" .) (int .Values.enrollment.port) }}
{{- end }}

{{/* Where a worker's init container puts its enrollment token, and the projected token it shows. */}}
{{- define "pdserve.enrollmentTokenDir" -}}/etc/pdserve/enrollment{{- end }}
{{- define "pdserve.enrollSaTokenDir" -}}/var/run/secrets/pdserve-enroll{{- end }}
