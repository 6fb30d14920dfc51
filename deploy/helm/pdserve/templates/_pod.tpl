{{/* Pieces shared by the router, prefill and decode pod templates. */}}

{{/* Pod-level fields. Call with (dict "ctx" $ "cfg" .Values.<role>), and "serviceAccount" to
run as another ServiceAccount than the release's. */}}
{{- define "pdserve.podSpec" -}}
serviceAccountName: {{ .serviceAccount | default (include "pdserve.serviceAccountName" .ctx) }}
# pdserve never talks to the API server.
automountServiceAccountToken: false
# Service links would inject PDSERVE_*_PORT variables, and the CLI reads PDSERVE_* variables.
enableServiceLinks: false
securityContext:
  {{- toYaml .ctx.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ .cfg.terminationGracePeriodSeconds }}
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .cfg.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .cfg.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .cfg.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .cfg.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .cfg.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod metadata. Call with (dict "ctx" $ "cfg" .Values.<role> "component" "<role>"). */}}
{{- define "pdserve.podMetadata" -}}
labels:
  {{- include "pdserve.labels" . | nindent 2 }}
  {{- with .cfg.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .cfg.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Startup, readiness and liveness probes: standard grpc.health.v1 on the role's gRPC port
(Kubernetes needs the number here, not the port's name). A port that asks for a client
certificate (`mutualTLS`: a worker's, under internal mutual TLS) cannot be called by the
kubelet, which holds none: its probes check that the port accepts connections (a worker
opens it once its model is loaded). Call with (dict "probes" .probes "port" <int>
"mutualTLS" <bool>).
*/}}
{{- define "pdserve.probes" -}}
{{- $port := int .port }}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{ $kind }}Probe:
  {{- if $.mutualTLS }}
  tcpSocket:
  {{- else }}
  grpc:
  {{- end }}
    port: {{ $port }}
  {{- toYaml (index $.probes $kind) | nindent 2 }}
{{- end }}
{{- end }}

{{/* Environment every pdserve container gets. Call with the root context. */}}
{{- define "pdserve.baseEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
# The root filesystem is read-only: home and caches live on emptyDir volumes.
- name: HOME
  value: /tmp
{{- end }}

{{/*
Where a container's build cache is. A worker whose cache an init container prepares
(buildCache.prepare) mounts it read-only and reads it as a seed (PDSERVE_CACHE_SEED): the
serving process can write no converted weights or kernel a later pod would load; what it
must build itself goes to its own /tmp. Call with (dict "ctx" $ "serving" bool).
*/}}
{{- define "pdserve.cacheEnv" -}}
{{- $cache := .ctx.Values.buildCache }}
{{- if and .serving $cache.prepare }}
- name: PDSERVE_CACHE_SEED
  value: {{ $cache.mountPath | quote }}
- name: PDSERVE_CACHE_ROOT
  value: /tmp/pdserve-cache
{{- else }}
- name: PDSERVE_CACHE_ROOT
  value: {{ $cache.mountPath | quote }}
{{- end }}
{{- end }}

{{/* Container resources with the role's GPU count. Call with the role's values. */}}
{{- define "pdserve.resources" -}}
{{- $res := deepCopy (default dict .resources) }}
{{- if gt (int (default 0 .gpus)) 0 }}
{{- $limits := default dict $res.limits }}
{{- $_ := set $limits "nvidia.com/gpu" (int .gpus) }}
{{- $_ := set $res "limits" $limits }}
{{- end }}
{{- toYaml $res }}
{{- end }}
